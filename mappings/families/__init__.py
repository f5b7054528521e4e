"""One module per model family; each defines FAMILY, a declarative table of rules."""
