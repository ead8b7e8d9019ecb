"""The results as tables and a Markdown report, as the docs page shows them, and as a plot."""
