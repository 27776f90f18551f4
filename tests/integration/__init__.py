"""Integration tests: this process talks to the real services (PostgreSQL, Redis, beanstalkd,
MariaDB); they skip locally when a service is down and fail under CI=true. No subprocesses."""
