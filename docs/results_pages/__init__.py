"""The results pages' code, one module per page or close group of pages: docs/gen_results.py."""
