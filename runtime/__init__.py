"""The Runtime: task streams, events, device memory and the task-stream interpreter (issue 4)."""
