"""Rank bookkeeping of the engine and the build under MPI: rank folders are loaded by number (rank10 is
rank 10, not the third folder in name order), and one launcher detection (PMI, Open MPI, PMIx) serves both."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from fp32_reorder import num_layers, reorder_atol
from moe_export.common.errors import InputError
from moe_export.common.mpi import mpi_world
from moe_export.common.recipe import load_recipe
from moe_export.export.build import build
from moe_export.runtime.engine.batch import SequenceChunk, StepBatch
from moe_export.runtime.engine.ort import Engine
from moe_export.runtime.engine.ranks import rank_folders

WORLD = 12  # tp=2, ep=4: ranks 10 and 11 exist, so name order and number order differ

MPIEXEC = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")

CHECK_OWN_MAPPING = """
import json, sys
import numpy as np
from mpi4py import MPI
from moe_export.runtime.engine.batch import SequenceChunk, StepBatch
from moe_export.runtime.engine.ort import Engine
rank = MPI.COMM_WORLD.Get_rank()
try:
    eng = Engine(sys.argv[1], num_slots=1, num_blocks=8, threads=1)
    mine = eng.ranks[0]
    assert mine.mapping.rank == rank, f"MPI rank {rank} loaded the mapping of rank {mine.mapping.rank}"
    assert mine.mapping.tp_rank == rank % 2 and mine.mapping.ep_rank == rank % 4, mine.mapping
except Exception as exc:  # one rank failing must not leave the others waiting in a collective
    print(f"rank {rank}: {exc}", file=sys.stderr, flush=True)
    MPI.COMM_WORLD.Abort(1)
eng.reset_slot(0)
logits = eng.step(StepBatch.from_sequences([SequenceChunk(0, 0, [5, 17, 99, 3], [0])]))
if rank == 0:
    np.save(sys.argv[2], logits)
print(f"rank {rank} ok")
"""


@pytest.fixture(scope="module")
def engine12(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("w12")
    base = yaml.safe_load(Path(load_recipe("tiny-cpu.yaml")[1]).read_text())
    base.update(name="tiny-k3-w12")
    base["target"]["gpus_per_node"] = WORLD
    base["parallel"] = {"tp": 2, "ep": 4}
    path = root / "w12.yaml"
    path.write_text(yaml.safe_dump(base))
    rec, _ = load_recipe(path)
    build(rec, root / "engine")
    return root / "engine"


def test_rank_folders_are_ordered_by_number(engine12):
    dirs = rank_folders(engine12)
    assert [d.name for d in dirs] == [f"rank{n}" for n in range(WORLD)]
    eng = Engine(engine12, num_slots=1, num_blocks=8, threads=1)
    assert [r.mapping.rank for r in eng.ranks] == list(range(WORLD))


def test_missing_rank_folder_is_refused(tmp_path):
    for n in (0, 1, 3):
        (tmp_path / f"rank{n}").mkdir()
    with pytest.raises(InputError, match=r"rank2"):
        rank_folders(tmp_path)


def test_mpiexec_12_ranks_each_loads_its_own_mapping(engine12, tmp_path):
    """Under `mpiexec -n 12` every process loads rank{its MPI rank}/ and the step's logits equal the
    in-process engine's (all 12 ranks run in lockstep in one process)."""
    out = tmp_path / "logits.npy"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([MPIEXEC, "-n", str(WORLD), sys.executable, "-c", CHECK_OWN_MAPPING, str(engine12), str(out)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sorted(int(n) for n in re.findall(r"rank (\d+) ok", r.stdout)) == list(range(WORLD))
    eng = Engine(engine12, num_slots=1, num_blocks=8, threads=1)
    eng.reset_slot(0)
    want = eng.step(StepBatch.from_sequences([SequenceChunk(0, 0, [5, 17, 99, 3], [0])]))
    # MPI's all-reduce adds the ranks' float32 partial sums in its own order
    np.testing.assert_allclose(np.load(out), want, atol=reorder_atol(want, num_layers(eng.model_config), eng.max_seq_len), rtol=0)


@pytest.mark.parametrize("env, want", [
    ({"PMI_RANK": "3", "PMI_SIZE": "12"}, (3, 12)),
    ({"OMPI_COMM_WORLD_RANK": "11", "OMPI_COMM_WORLD_SIZE": "12"}, (11, 12)),
    ({"HOME": "/root"}, None),
])
def test_mpi_world_reads_pmi_and_open_mpi(env, want):
    assert mpi_world(env) == want


def test_pmix_launch_is_detected_by_build_and_engine(tmp_path):
    """A PMIx-style launch (PMIX_RANK only) is seen by the one detection function that the build driver and
    the engine both call; the size comes from MPI. MPICH's PMI variables are dropped after MPI has started
    from them, so the detection sees only PMIX_RANK. Each rank writes its own file (ranks' stdout interleaves
    under load)."""
    code = ("import os, sys; from mpi4py import MPI; "
            "os.environ['PMIX_RANK'] = os.environ.pop('PMI_RANK'); del os.environ['PMI_SIZE']; "
            "from moe_export.export import build; from moe_export.common import mpi; from moe_export.runtime.engine import ort; "
            "assert ort.mpi_world is mpi.mpi_world; "
            "c = mpi.world_comm(); "
            "open(os.path.join(sys.argv[1], f'rank{c.rank}'), 'w').write(f'{mpi.mpi_world()} {c.rank} {c.size}')")
    r = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["(0, 2) 0 2", "(1, 2) 1 2"]
