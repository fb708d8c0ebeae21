"""The run's durable state: the database engines, the Store over them and its repositories (one per aggregate),
its read-only views and the tmpfs folder."""
