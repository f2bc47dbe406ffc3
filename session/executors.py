"""Where getune's candidates are timed: in this process, or on Ray workers (a local Ray or a cluster).

An executor maps a module-level function over picklable jobs and yields (index, result) as the jobs finish,
so the caller stores each result as it arrives. Ray is the optional `tune` extra: imported only when a Ray
executor is made.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Protocol, Sequence


class Executor(Protocol):
    """Runs jobs somewhere; `workers` is how many run at once."""

    workers: int

    def map_unordered(self, fn: Callable[[Any], Any], jobs: Sequence[Any]) -> Iterator[tuple[int, Any]]: ...

    def map(self, fn: Callable[[Any], Any], jobs: Sequence[Any]) -> list[Any]: ...


class InProcess:
    """The jobs one after the other in this process (getune --workers 0; tests without Ray)."""

    workers = 1

    def map_unordered(self, fn: Callable[[Any], Any], jobs: Sequence[Any]) -> Iterator[tuple[int, Any]]:
        for i, job in enumerate(jobs):
            yield i, fn(job)

    def map(self, fn: Callable[[Any], Any], jobs: Sequence[Any]) -> list[Any]:
        return [fn(job) for job in jobs]

    def close(self) -> None:
        pass


class RayUnavailable(RuntimeError):
    """Ray is not installed, or the cluster cannot be reached; the message says which and what to do."""


class OnRay:
    """The jobs as Ray tasks: on a local Ray this executor starts (`num_cpus=workers`), or on the cluster at
    `address` (then `workers` is the cluster's CPUs). Each task takes one CPU."""

    def __init__(self, workers: int | None = None, address: str | None = None):
        try:
            import ray
        except ImportError:
            raise RayUnavailable("Ray is not installed: pip install -e '.[tune]' (or --workers 0 to tune in this "
                                 "process)") from None
        self._ray = ray
        self._started = False
        try:
            if not ray.is_initialized():
                kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                          "configure_logging": False}
                if address:
                    ray.init(address=address, **kwargs)
                else:
                    ray.init(num_cpus=workers, **kwargs)
                self._started = True
        except (ConnectionError, RuntimeError, ValueError) as e:
            where = f"the Ray cluster at {address}" if address else "a local Ray"
            raise RayUnavailable(f"cannot start {where}: {e}") from None
        self.workers = int(ray.cluster_resources().get("CPU", workers or 1))
        self._remote: dict[Callable, Any] = {}

    def _task(self, fn: Callable[[Any], Any]) -> Any:
        if fn not in self._remote:
            self._remote[fn] = self._ray.remote(num_cpus=1)(fn)
        return self._remote[fn]

    def map_unordered(self, fn: Callable[[Any], Any], jobs: Sequence[Any]) -> Iterator[tuple[int, Any]]:
        ray = self._ray
        task = self._task(fn)
        pending = {task.remote(job): i for i, job in enumerate(jobs)}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                yield pending.pop(ref), ray.get(ref)

    def map(self, fn: Callable[[Any], Any], jobs: Sequence[Any]) -> list[Any]:
        out: list[Any] = [None] * len(jobs)
        for i, result in self.map_unordered(fn, jobs):
            out[i] = result
        return out

    def close(self) -> None:
        """Shut down the Ray this executor started (a cluster it joined keeps running)."""
        if self._started:
            self._ray.shutdown()
            self._started = False
