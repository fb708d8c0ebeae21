"""What the role processes share to meet each other: the run's files, the work queue between roles, the
doorbell, the roles' names and the records that cross a role boundary."""
