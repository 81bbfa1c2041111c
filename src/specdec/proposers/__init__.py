"""Proposers: cheap guesses of the next K tokens. One file per method."""
