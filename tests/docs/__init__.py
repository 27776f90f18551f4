"""Tests that run the documentation: the quickstart and the README are followed for real, and
the reference pages' defaults and exit statuses are checked against the code. The code blocks
are read from the Markdown files, so editing a page changes what runs."""
