"""An installed app whose ``jobs`` module cannot be imported (the checks' tests add it)."""
