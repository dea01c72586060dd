"""What vToken reports and watches: counters and digests, the log line and Prometheus series, the integrity check
in the running server, and the debug instruments (host reads, hook time, the victim log)."""
