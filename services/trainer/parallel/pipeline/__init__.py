"""Pipeline parallelism: stages (`stage`), schedules as data (`schedules`), the runtime that runs
them (`runtime`)."""
