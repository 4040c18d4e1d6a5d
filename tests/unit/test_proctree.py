"""Killing a trial's process tree, against a fake process table: what a kill must reach (a
process forked while the tree is being stopped, an orphan reparented to the launcher), that it
waits until each process has ended, and what it never touches."""

from __future__ import annotations

from advisor.trial._proctree import SIGKILL, SIGSTOP, kill_tree, live_descendants, process_table

ROOT = 10  # the launcher, a child subreaper


class World:
    """A process table that signals change, as the kernel would, one read at a time.

    Args:
        table: pid -> (ppid, state).
        forks_on_stop: pid -> a child it creates as its stop takes effect (a fork under way).
        exit_reads: reads of the table a killed process takes to become a zombie.
        unkillable: processes that never end (uninterruptible sleep in a driver).
    """

    def __init__(self, table, *, forks_on_stop=None, exit_reads=0, unkillable=()):
        self.table = dict(table)
        self.forks_on_stop = dict(forks_on_stop or {})
        self.exit_reads = exit_reads
        self.unkillable = set(unkillable)
        self.dying: dict[int, int] = {}
        self.signals: list[tuple[int, int]] = []
        self.now = 0.0

    def read(self):
        for pid in list(self.dying):
            self.dying[pid] -= 1
            if self.dying[pid] < 0:
                del self.dying[pid]
                self.end(pid)
        return dict(self.table)

    def end(self, pid):
        ppid, _ = self.table[pid]
        self.table[pid] = (ppid, "Z")
        for child, (parent, state) in self.table.items():
            if parent == pid:
                self.table[child] = (ROOT, state)  # an orphan goes to the subreaper

    def send(self, pid, sig):
        self.signals.append((pid, sig))
        ppid, state = self.table[pid]
        if state == "Z" or (pid in self.dying and sig == SIGSTOP):
            return  # a killed process stops no more
        if sig == SIGSTOP:
            self.table[pid] = (ppid, "T")
            if pid in self.forks_on_stop:
                self.table[self.forks_on_stop.pop(pid)] = (pid, "R")
        elif sig == SIGKILL and pid not in self.unkillable:
            self.table[pid] = (ppid, "R")
            self.dying.setdefault(pid, self.exit_reads)

    def sleep(self, seconds):
        self.now += seconds

    def clock(self):
        return self.now

    def kill(self, **kwargs):
        return kill_tree(ROOT, table=self.read, send=self.send, sleep=self.sleep, clock=self.clock, **kwargs)

    def running(self):
        return live_descendants(self.table, ROOT)


# torchrun's agent (11) below the launcher; its workers 12 and 13 in sessions of their own; an
# unrelated process (20) and the launcher's own parent (9).
TORCHRUN = {9: (1, "S"), ROOT: (9, "S"), 11: (ROOT, "S"), 12: (11, "S"), 13: (11, "R"), 20: (1, "R")}


def test_every_process_below_the_launcher_ends_and_nothing_else_is_signalled():
    world = World(TORCHRUN)
    assert world.kill() == []
    assert world.running() == []
    assert {pid for pid, _ in world.signals} == {11, 12, 13}
    # Each is stopped before any is killed: a stopped process neither forks nor exits meanwhile.
    stops = [i for i, (_, sig) in enumerate(world.signals) if sig == SIGSTOP]
    kills = [i for i, (_, sig) in enumerate(world.signals) if sig == SIGKILL]
    assert len(stops) == 3 and max(stops) < min(kills)


def test_a_kill_waits_until_each_process_has_exited():
    # A worker with many threads or much memory takes a while to exit after SIGKILL, longer on
    # a loaded machine: a kill that returned at once left it running when the trial ended.
    world = World(TORCHRUN, exit_reads=5)
    assert world.kill() == []
    assert world.running() == []
    assert world.now > 0


def test_a_child_forked_while_the_tree_is_being_stopped_is_killed_too():
    world = World(TORCHRUN, forks_on_stop={13: 14})
    assert world.kill() == []
    assert world.table[14][1] == "Z"
    assert (14, SIGSTOP) in world.signals and (14, SIGKILL) in world.signals


def test_an_orphan_reparented_to_the_launcher_is_still_killed():
    # The agent (11) exits at once; its workers, reparented to the launcher, are not yet dead.
    world = World(TORCHRUN, exit_reads=1)
    world.send(11, SIGKILL)
    world.signals.clear()
    assert world.kill() == []
    assert world.table[12][0] == world.table[13][0] == ROOT
    assert world.running() == []


def test_a_process_that_will_not_die_is_reported_when_the_time_is_up():
    world = World(TORCHRUN, unkillable={12})
    assert world.kill(timeout=1.0) == [12]
    assert world.now >= 1.0
    assert world.table[13][1] == "Z"


def test_zombies_are_not_running_and_are_not_signalled():
    world = World({ROOT: (9, "S"), 11: (ROOT, "Z")})
    assert world.kill() == []
    assert world.signals == []


def test_the_process_table_reads_the_state_and_the_parent_after_the_command_name(tmp_path):
    for pid, stat in {
        "7": "7 (python3) S 1 7 7 0 -1",
        "8": "8 (a (b) c) R 7 8 8 0 -1",  # a command name with spaces and parentheses
        "9": "9 (pt_elastic) Z 8 9 9 0 -1",
        "self": "1 (init) S 0 1 1 0 -1",  # not a pid
    }.items():
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "stat").write_text(stat)
    (tmp_path / "10").mkdir()  # ended while the table was read: no stat
    assert process_table(tmp_path) == {7: (1, "S"), 8: (7, "R"), 9: (8, "Z")}
    assert process_table(tmp_path / "missing") == {}
