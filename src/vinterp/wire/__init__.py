"""Everything that crosses a process or network boundary, as plain data (never pickle)."""
