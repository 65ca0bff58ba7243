"""The multi-cycle scheduler: profile handler, profiles (filters → scorers → picker)."""
