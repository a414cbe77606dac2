"""The ground every layer stands on: structured events, fork-safe locks, byte sizes and
configuration files. Imports nothing of hostpool but `hostpool.errors`."""
