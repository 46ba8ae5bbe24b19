"""A worker that fails to start (its ``__init__`` raised, or hung past ``startup_timeout_s``) is replaced and costs
no unit an attempt: none of its units began. A slot whose workers keep failing to start is given up, and the run
fails with the worker's own error, not with advice about memory. Real Ray actors on the session's Ray; each start is
one line in a file, so a start can fail a given number of times."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from embedpipe.cluster.scheduler import Liveness, NoWorkerStarted, Scheduler, worker_actor
from embedpipe.units import Unit

pytestmark = pytest.mark.slow
ray_pickle = pytest.importorskip("ray.cloudpickle")
ray_pickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import this test module


class StartingWorker:
    """Its first ``bad_starts`` starts (counted in the file ``starts``) raise, or hang when ``hang``."""

    def __init__(self, starts: str, bad_starts: int, hang: bool):
        path = Path(starts)
        with path.open("a") as f:
            f.write("start\n")
        if len(path.read_text().splitlines()) <= bad_starts:
            if hang:
                time.sleep(600)
            test = path.parent.name.rstrip("0123456789")  # its own words: Ray's log dedup hides a repeated line
            raise FileNotFoundError(f"the model's weights are missing on this node: /models/{test}/model.safetensors")

    def process(self, unit: Unit, ahead: Unit | None = None) -> str:
        return unit.id


def _units(n: int) -> list[Unit]:
    return [Unit(id=f"00000-{i:05d}", file="corpus.parquet", row_groups=(i,), num_rows=10) for i in range(n)]


def _run(starts: Path, *, bad_starts: int, hang: bool = False, startup_timeout_s: float = 60) -> Scheduler:
    actor_cls = worker_actor(StartingWorker).options(num_cpus=0, max_restarts=0)
    scheduler = Scheduler(make_actor=lambda slot: actor_cls.remote(str(starts), bad_starts, hang), workers=1,
                          max_attempts=3, depth=2,
                          liveness=Liveness(unit_timeout_s=60, startup_timeout_s=startup_timeout_s,
                                            placement_timeout_s=30))
    assert sorted(scheduler.run(_units(3))) == [u.id for u in _units(3)]
    return scheduler


@pytest.mark.parametrize("hang, bad_starts", [(False, 2), (True, 1)], ids=["raised", "hung"])
def test_a_worker_that_fails_to_start_is_replaced_and_no_unit_loses_an_attempt(tmp_path, ray_session, hang,
                                                                              bad_starts):
    starts = tmp_path / "starts.txt"
    scheduler = _run(starts, bad_starts=bad_starts, hang=hang, startup_timeout_s=3 if hang else 60)
    assert len(starts.read_text().splitlines()) == bad_starts + 1  # the failed starts, then one that took every unit
    assert scheduler.replaced == bad_starts and scheduler.given_up == 0
    assert scheduler.retries == [] and scheduler.retried == 0  # no unit paid for the starts
    why = "did not start within 3 s" if hang else "the model's weights are missing on this node"
    assert [f.worker for f in scheduler.start_failures] == [0] * bad_starts  # for the report, each with its node
    assert all(why in f.error and f.node for f in scheduler.start_failures), scheduler.start_failures


def test_a_slot_whose_workers_never_start_fails_the_run_with_their_own_error(tmp_path, ray_session):
    starts = tmp_path / "starts.txt"
    with pytest.raises(NoWorkerStarted) as raised:
        _run(starts, bad_starts=99)
    line = raised.value.line()
    assert raised.value.exit_code == 4
    assert len(starts.read_text().splitlines()) == 3  # max_attempts starts, then the slot was given up
    assert line.startswith("no worker could start: worker 0 failed to start 3 times in a row, last: "), line
    test = tmp_path.name.rstrip("0123456789")
    assert f"the model's weights are missing on this node: /models/{test}/model.safetensors" in line, line
    assert "memory" not in line and "rerun the same command to resume" in line, line


def _forwarded(ray, capfd, marker: str) -> str:
    """The lines Ray's ``log_to_driver`` printed on the driver's stderr (``(Class pid=N) ...``; not the driver's own
    log), up to ``marker``: printed by a task after the run, it comes after every worker line the run caused."""

    @ray.remote(num_cpus=0)
    def say() -> None:
        print(marker, file=sys.stderr, flush=True)

    ray.get(say.remote())
    seen, deadline = "", time.monotonic() + 30
    while marker not in seen and time.monotonic() < deadline:
        time.sleep(0.2)
        seen += capfd.readouterr().err
    assert marker in seen, seen
    return "\n".join(line for line in seen.splitlines() if " pid=" in line)


def test_a_failed_start_prints_no_traceback_from_ray(tmp_path, ray_session, capfd):
    starts = tmp_path / "starts.txt"
    capfd.readouterr()
    scheduler = _run(starts, bad_starts=1)
    assert scheduler.start_failures and "the model's weights are missing" in scheduler.start_failures[0].error
    forwarded = _forwarded(ray_session, capfd, marker=f"after the run in {tmp_path.name}")
    assert f"/models/{tmp_path.name.rstrip('0123456789')}/" not in forwarded, forwarded  # the driver's line says it
    assert "creation task" not in forwarded, forwarded


class SamplingWorker(StartingWorker):
    """A StartingWorker whose ``sample`` (a call before the run, as the calibration's) kills its process the first
    time (the file ``dies`` then exists), and answers with its pid."""

    def sample(self, texts: list[str], dies: str) -> tuple[list[str], int]:
        if not Path(dies).exists():
            Path(dies).write_text("died\n")
            os._exit(1)
        time.sleep(0.2)  # long enough for the other worker to take a piece of its own
        return [t.upper() for t in texts], os.getpid()


def test_calls_before_the_run_go_to_every_worker_up_and_failed_ones_are_replaced(tmp_path, ray_session):
    """share (the int8 calibration's sample, embedded by the run's workers): the first worker of slot 0 failed its
    start, and the first worker to take a piece died in the call; each was replaced as a failed start, its piece
    taken again. Every piece is answered, in order, the pieces spread over both slots' workers, which then take the
    run's units, none of which lost an attempt."""
    starts, dies = tmp_path / "starts.txt", tmp_path / "dies.txt"
    actor_cls = worker_actor(SamplingWorker).options(num_cpus=0, max_restarts=0)
    scheduler = Scheduler(make_actor=lambda slot: actor_cls.remote(str(starts), 1, False), workers=2,
                          max_attempts=3, depth=2,
                          liveness=Liveness(unit_timeout_s=60, startup_timeout_s=60, placement_timeout_s=30))
    pieces = [[f"t{i}a", f"t{i}b"] for i in range(6)]
    answers = scheduler.share(pieces, lambda actor, piece: actor.sample.remote(piece, str(dies)))
    assert [texts for texts, _ in answers] == [[t.upper() for t in piece] for piece in pieces]
    assert len({pid for _, pid in answers}) == 2  # both workers took pieces
    assert len(starts.read_text().splitlines()) == 4 and dies.exists()  # 2 + the two replacements
    assert scheduler.replaced == 2 and len(scheduler.start_failures) == 2
    assert any("the model's weights are missing" in f.error for f in scheduler.start_failures), \
        scheduler.start_failures
    assert sorted(scheduler.run(_units(3))) == [u.id for u in _units(3)]
    assert len(starts.read_text().splitlines()) == 4 and scheduler.retried == 0  # the same workers took them


def test_a_workers_other_calls_raise_its_failed_starts_error(tmp_path, ray_session):
    actor_cls = worker_actor(SamplingWorker).options(num_cpus=0, max_restarts=0)
    actor = actor_cls.remote(str(tmp_path / "s.txt"), 9, False)
    with pytest.raises(FileNotFoundError, match="the model's weights are missing"):  # not an AttributeError
        ray_session.get(actor.sample.remote(["a"], str(tmp_path / "dies.txt")))
    assert not (tmp_path / "dies.txt").exists()


class ConfiguredWorker:
    """Starts at once; its ``configure`` (the run's settings, its ready call) raises for the first ``bad`` calls
    (counted in the file ``configures``). ``process`` answers with the setting it was configured with."""

    def __init__(self, configures: str, bad: int):
        self.configures, self.bad, self.setting = Path(configures), bad, None

    def configure(self, setting: str) -> None:
        with self.configures.open("a") as f:
            f.write("configure\n")
        if len(self.configures.read_text().splitlines()) <= self.bad:
            raise PermissionError(f"the output {self.configures.parent.name} is not writable from this node")
        self.setting = setting

    def process(self, unit: Unit, ahead: Unit | None = None) -> str:
        return f"{unit.id} {self.setting}"


def _early(configures: Path, *, bad: int, workers: int) -> Scheduler:
    actor_cls = worker_actor(ConfiguredWorker).options(num_cpus=0, max_restarts=0)
    scheduler = Scheduler(make_actor=lambda slot: actor_cls.remote(str(configures), bad), workers=workers,
                          max_attempts=3, depth=2,
                          liveness=Liveness(unit_timeout_s=60, startup_timeout_s=60, placement_timeout_s=30))
    scheduler.start()  # asked for before the units are known (beside the driver's id scan)
    return scheduler


def test_workers_started_before_the_run_are_configured_by_it_and_a_failed_configure_is_a_failed_start(tmp_path,
                                                                                                     ray_session):
    """start() asks for the actors before run() has units; run() gives each its settings by its ready call. A
    configure that raises is a failed start: the worker is replaced (and configured in its turn), no unit loses an
    attempt. keep() ends the slots beyond the units."""
    configures = tmp_path / "configures.txt"
    scheduler = _early(configures, bad=1, workers=2)
    first = scheduler._slots[0].actor
    scheduler.keep(1)
    assert scheduler.workers == 1 and len(scheduler._slots) == 1 and scheduler._slots[0].actor is first
    assert configures.exists() is False  # nothing configured before run()
    results = sorted(scheduler.run(_units(3), ready=lambda actor: actor.configure.remote("night-1")))
    assert results == [f"{u.id} night-1" for u in _units(3)]
    assert len(configures.read_text().splitlines()) == 2  # the first worker's configure failed, its replacement's
    assert scheduler.replaced == 1 and scheduler.retried == 0 and scheduler.retries == []
    assert [f.worker for f in scheduler.start_failures] == [0]
    assert "is not writable from this node" in scheduler.start_failures[0].error, scheduler.start_failures


def test_workers_started_for_a_run_that_never_comes_are_ended_by_stop(tmp_path, ray_session):
    scheduler = _early(tmp_path / "configures.txt", bad=0, workers=2)
    actors = [slot.actor for slot in scheduler._slots]
    ray_session.get([actor.started.remote() for actor in actors])  # both up
    scheduler.stop()
    assert all(_dies(ray_session, actor) for actor in actors)


def _dies(ray, actor, *, within_s: float = 30) -> bool:
    """Whether ``actor`` is gone within ``within_s`` (ray.kill is asynchronous: a call made just after it may still
    be answered)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.started.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return True
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.1)
    return False


def test_an_ask_that_fails_part_way_ends_the_workers_already_asked_for(tmp_path, ray_session):
    actor_cls = worker_actor(ConfiguredWorker).options(num_cpus=0, max_restarts=0)
    made = []

    def make_actor(slot: int):
        if slot == 1:
            raise ValueError("no such node pool")
        made.append(actor_cls.remote(str(tmp_path / "configures.txt"), 0))
        return made[-1]

    scheduler = Scheduler(make_actor=make_actor, workers=2)
    with pytest.raises(ValueError, match="no such node pool"):
        scheduler.start()
    assert len(made) == 1 and _dies(ray_session, made[0])
