"""What happens at send (``apply_async``): deduplication, debounce, and the records a send writes
before its message leaves."""
