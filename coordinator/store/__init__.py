"""The run's durable state: the database engines, the Store over them, its read-only views and the tmpfs folder."""
