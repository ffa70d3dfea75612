"""sparsecore."""
