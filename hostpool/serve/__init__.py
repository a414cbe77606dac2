"""`hostpool serve`: a managed memory service an operator can scrape."""
