"""The core: the process-wide ledger and its records, admission (budgets and their
policies), the allocators, the manager, and what this host can give (doctor)."""
