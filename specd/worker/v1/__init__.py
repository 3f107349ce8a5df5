"""The internal worker protocol (protos/specd/worker/v1), generated."""
