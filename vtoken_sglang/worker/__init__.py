"""The compaction worker: reclaim planning in its own process, over ZMQ, off the scheduler loop."""
