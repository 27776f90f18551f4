"""A jobs module whose import fails, as one with a typo in an import does."""

from tests.brokenapp.no_such_helpers import send  # noqa: F401 - the failure under test
