"""The recipes singletask is compared with, re-implemented for the benchmark."""
