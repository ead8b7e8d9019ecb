"""What is measured: ``python -m bench SUITE`` runs one (see bench/__main__.py)."""
