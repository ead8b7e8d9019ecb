"""What happens at execution (``__call__``): acquire, run the body with its lease renewed, end the
hold once; the endings a worker's main process sees, and the worker's start."""
