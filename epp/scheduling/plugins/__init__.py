"""Built-in scheduler plugins (filters, scorers, pickers, profile handlers)."""
