"""Weights through shared memory: what the trainer writes is what another process maps, tensor by
tensor, with slots kept across versions and no tensor pickled."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashreinforce.engines.vllm.shared_weights import ALIGNMENT, SharedWeightWriter, read_manifest
from python_tests.envs.unprivileged import UNPRIVILEGED_UID

ROOT = Path(__file__).resolve().parents[2]


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(3, 5, generator=g), "b.bias": torch.randn(7, generator=g).to(torch.bfloat16),
            "c.scale": torch.randn(2, 2, 2, generator=g, dtype=torch.float64)}


def test_a_version_round_trips_exactly_with_aligned_slots():
    writer = SharedWeightWriter()
    try:
        state = _tensors(0)
        manifest = writer.write(state.items())
        assert os.path.dirname(manifest.path) in ("/dev/shm", os.path.dirname(manifest.path))
        assert all(offset % ALIGNMENT == 0 for _, _, _, offset in manifest.entries)
        got = dict(read_manifest(manifest.as_plain()))
        assert set(got) == set(state)
        for name, t in state.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t)
    finally:
        writer.close()
    assert not os.path.exists(manifest.path)


def test_a_subset_keeps_its_slots_and_the_others_keep_their_values():
    writer = SharedWeightWriter()
    try:
        first = writer.write(_tensors(0).items())
        new_b = torch.full((7,), 2.5, dtype=torch.bfloat16)
        second = writer.write([("b.bias", new_b)])
        assert second.path == first.path and [e[0] for e in second.entries] == ["b.bias"]
        assert second.entries[0][3] == next(e[3] for e in first.entries if e[0] == "b.bias")
        got = dict(read_manifest(first))  # every slot, as the file holds them now
        assert torch.equal(got["b.bias"], new_b) and torch.equal(got["a.weight"], _tensors(0)["a.weight"])
        # A shape the layout has no slot for starts a new buffer (and removes the old file).
        third = writer.write([("a.weight", torch.zeros(4, 5))])
        assert third.path != first.path and not os.path.exists(first.path)
    finally:
        writer.close()


def test_a_cast_on_the_way_and_an_empty_version_refused():
    writer = SharedWeightWriter()
    try:
        manifest = writer.write(_tensors(1).items(), dtype=torch.float16)
        assert {e[1] for e in manifest.entries} == {"float16"}
        got = dict(read_manifest(manifest))
        assert torch.equal(got["a.weight"], _tensors(1)["a.weight"].half())
        with pytest.raises(ValueError, match="no tensors"):
            writer.write([])
    finally:
        writer.close()


def test_another_process_reads_the_same_memory(tmp_path):
    writer = SharedWeightWriter()
    try:
        state = _tensors(2)
        manifest = writer.write(state.items())
        code = ("import json, sys, torch; from flashreinforce.engines.vllm.shared_weights import read_manifest; "
                "m = json.loads(sys.argv[1]); print(json.dumps({n: float(t.double().sum()) for n, t in read_manifest(m)}))")
        import json

        proc = subprocess.run([sys.executable, "-c", code, json.dumps(manifest.as_plain())], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        sums = json.loads(proc.stdout)
        for name, t in state.items():
            assert sums[name] == pytest.approx(float(t.double().sum()), rel=1e-12)
    finally:
        writer.close()


# ------------------------------------------------------------------ other users of the machine
def test_the_buffer_file_is_private_to_this_user(tmp_path):
    writer = SharedWeightWriter()
    try:
        manifest = writer.write(_tensors(3).items())
        st = os.lstat(manifest.path)
        assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600
        if os.geteuid() == 0:  # a second, unprivileged account cannot read the weights
            done = subprocess.run(["/bin/cat", manifest.path], user=UNPRIVILEGED_UID, group=UNPRIVILEGED_UID,
                                  extra_groups=[], capture_output=True, timeout=60, cwd="/")
            assert done.returncode != 0 and b"Permission denied" in done.stderr and not done.stdout
    finally:
        writer.close()


def test_a_planted_file_or_symlink_at_the_buffer_s_name_is_never_written_through(tmp_path, monkeypatch):
    import flashreinforce.engines.vllm.shared_weights as sw

    monkeypatch.setattr(sw.secrets, "token_hex", lambda n: "planted")
    victim = tmp_path / "victim"
    victim.write_bytes(b"someone's file")
    link = Path(sw.shared_memory_dir()) / f"flashreinforce-weights-{os.getpid()}-planted"
    link.symlink_to(victim)
    writer = SharedWeightWriter()
    try:
        with pytest.raises(FileExistsError):
            writer.write(_tensors(0).items())
        assert victim.read_bytes() == b"someone's file" and link.is_symlink()
    finally:
        writer.close()
        link.unlink()


def test_the_reader_maps_only_a_private_file_of_its_own_user(tmp_path):
    writer = SharedWeightWriter()
    try:
        manifest = writer.write(_tensors(4).items())
        path = manifest.path
        for how in ("world-readable", "symlink", "another user's"):
            other = Path(path + "-" + how.split()[0].replace("'", ""))
            if how == "symlink":
                other.symlink_to(path)
            else:
                other.write_bytes(Path(path).read_bytes())
                other.chmod(0o644 if how == "world-readable" else 0o600)
                if how == "another user's":
                    if os.geteuid() != 0:
                        other.unlink()
                        continue
                    os.chown(other, UNPRIVILEGED_UID, UNPRIVILEGED_UID)
            try:
                with pytest.raises(PermissionError, match="is not a private file of this user"):
                    read_manifest({**manifest.as_plain(), "path": str(other)})
            finally:
                other.unlink()
        assert len(read_manifest(manifest)) == 3
    finally:
        writer.close()
