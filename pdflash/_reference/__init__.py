"""Pure-Python references of the native hot loops, for differential tests only."""
