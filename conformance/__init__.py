"""kvrows.conformance."""
