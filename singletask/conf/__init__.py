"""Settings and options: the app's ``singletask_*`` settings, each task's ``lock_*`` options, and
what is kept per app and per process."""
