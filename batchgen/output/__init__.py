"""The output directory: shards, the commit protocol, fingerprints, reports."""
