"""Checks for an extension of dbsn, in one call each."""
