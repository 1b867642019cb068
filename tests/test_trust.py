"""Nothing is loaded unchecked: payloads in any file kind (a DCP byte entry, the RNG state) are UnsafeCheckpoint,
storage paths and manifest entries that leave the directory are refused before anything is read, exports carry a
manifest that load_model and --init_from check (their modes follow the umask), a damaged config is found before
anything is built, and an export interrupted by a kill is done again by --resume."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_checkpoint import RUN, _Payload, flip_bit, forge_manifest
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import train
from storage.checkpoint import UnsafeCheckpoint
from storage.manifest import MANIFEST_NAME, DamagedCheckpoint
from storage.weights import load_model
from training import trainer


@pytest.fixture
def run_dir(data_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    train.main([*RUN, "--data_dir", str(data_dir), "--out_dir", str(out)])
    return out


def test_a_payload_in_a_byte_entry_or_the_rng_state_runs_nothing(run_dir, data_dir, tmp_path):
    marker = tmp_path / "marker"
    step = run_dir / "step-2"
    dcp_to_torch_save(step, tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=False)  # the test's own file
    state["optim"]["param_groups"][0]["lr"] = _Payload(marker)  # a byte entry (not a tensor) of the checkpoint
    for f in (*step.glob("*.distcp"), step / ".metadata"):
        f.unlink()
    dcp.save(state, checkpoint_id=step, no_dist=True)  # pickles the payload; nothing runs
    forge_manifest(step)
    resume = [*RUN, "--max_steps", "3", "--data_dir", str(data_dir), "--out_dir", str(run_dir), "--resume", str(step)]
    with pytest.raises(UnsafeCheckpoint, match="step-2 is not safe to load: its entry optim.param_groups.*holds an "
                                               "object that is not plain tensors") as error:
        train.main(resume)
    assert "weights_only" not in str(error.value)
    torch.save(_Payload(marker), run_dir / "step-1" / "rng_rank0.pt")
    forge_manifest(run_dir / "step-1")
    with pytest.raises(UnsafeCheckpoint, match="step-1 is not safe to load: rng_rank0.pt holds an object"):
        train.main([*resume[:-1], str(run_dir / "step-1")])
    assert not marker.exists()


def test_paths_outside_the_checkpoint_are_refused(run_dir, tmp_path):
    step = run_dir / "step-2"
    outside = tmp_path / "elsewhere.distcp"
    shutil.copy(next(step.glob("*.distcp")), outside)
    metadata = pickle.loads((step / ".metadata").read_bytes())  # the test's own file
    for info in metadata.storage_data.values():
        info.relative_path = os.path.relpath(outside, step)
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    forge_manifest(step)
    with pytest.raises(UnsafeCheckpoint, match="points a tensor at '../../elsewhere.distcp', outside the checkpoint"):
        load_model(step)
    manifest = json.loads((run_dir / "step-1" / MANIFEST_NAME).read_text())
    manifest["files"]["../../elsewhere.distcp"] = {"bytes": 10**12, "crc32": []}
    (run_dir / "step-1" / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(DamagedCheckpoint, match="names files outside the directory"):
        load_model(run_dir / "step-1")


def test_exports_are_checked_and_readable(run_dir, data_dir, tmp_path):
    model_file = run_dir / "model" / "model.safetensors"
    assert (run_dir / "model" / MANIFEST_NAME).is_file() and (run_dir / "hf" / MANIFEST_NAME).is_file()
    umask = os.umask(0)
    os.umask(umask)
    assert model_file.stat().st_mode & 0o777 == 0o666 & ~umask  # not safetensors' 0600
    flip_bit(model_file, model_file.stat().st_size - 100)
    with pytest.raises(DamagedCheckpoint, match="model is damaged: model.safetensors has CRC-32"):
        load_model(run_dir / "model")
    with pytest.raises(DamagedCheckpoint, match="model is damaged"):
        train.main([*RUN, "--init_from", str(run_dir / "model"), "--data_dir", str(data_dir),
                    "--out_dir", str(tmp_path / "tuned")])
    assert not (tmp_path / "tuned" / "config.json").exists()
    (run_dir / "hf" / MANIFEST_NAME).unlink()  # a Hugging Face directory from elsewhere: no manifest, still loads
    assert load_model(run_dir / "hf").config.vocab_size == 512


def test_a_damaged_config_is_found_before_anything_is_built(run_dir, tmp_path):
    state_file = run_dir / "step-2" / "train_state.json"
    state = json.loads(state_file.read_text())
    state["model_config"]["dim"] = 2**20  # a 4 TiB model if it were built
    state_file.write_text(json.dumps(state))
    with pytest.raises(DamagedCheckpoint, match="train_state.json"):
        load_model(run_dir / "step-2")
    hf_config = json.loads((run_dir / "hf" / "config.json").read_text())
    hf_config["hidden_size"] = 4096
    (run_dir / "hf" / "config.json").write_text(json.dumps(hf_config))
    (run_dir / "hf" / MANIFEST_NAME).unlink()
    with pytest.raises(ValueError, match="does not fit its config"):
        load_model(run_dir / "hf")


def test_an_interrupted_export_is_done_again(run_dir, data_dir, capsys):
    shutil.rmtree(run_dir / "model")  # killed during the export: the final checkpoint exists, the export does not
    (run_dir / trainer.FINISHED_NAME).unlink()
    train.main([*RUN, "--data_dir", str(data_dir), "--out_dir", str(run_dir), "--resume"])
    assert "the run's end (its export) did not complete: doing it again" in capsys.readouterr().out
    assert load_model(run_dir / "model").config.vocab_size == 512
    train.main([*RUN, "--data_dir", str(data_dir), "--out_dir", str(run_dir), "--resume"])
    assert "nothing to train" in capsys.readouterr().out


def test_an_adapter_run_resumes_only_on_its_own_base(run_dir, data_dir, tmp_path):
    """A LoRA checkpoint holds no base: resume refuses another --init_from, and without one continues on the base
    the run recorded."""
    lora = [*RUN, "--finetune", "lora", "--lr", "1e-2", "--data_dir", str(data_dir), "--out_dir", str(tmp_path / "a")]
    train.main([*lora, "--init_from", str(run_dir / "model")])
    other = tmp_path / "other"
    shutil.copytree(run_dir / "model", other)
    flip_bit(other / "model.safetensors", (other / "model.safetensors").stat().st_size - 100)
    forge_manifest(other)  # a different base that is intact in itself
    more = ["--max_steps", "3", "--resume"]
    with pytest.raises(ValueError, match=r"adapts .*model \(checksum \w+\), but this run's base is .*other"):
        train.main([*lora, "--init_from", str(other), *more])
    assert train.main([*lora, *more])["step"] == 3


def test_a_run_started_from_adapters_resumes_after_they_are_gone(run_dir, data_dir, tmp_path):
    """A LoRA run started from --adapter DIR resumes from its checkpoint, which holds the adapters it trains, and
    its record, which holds their rank, alpha and targets, after DIR is moved away, or replaced by adapters of
    another rank and alpha (the --adapter it recorded is not read again): to the adapters it ends with
    uninterrupted, bit for bit."""
    from safetensors.torch import load_file

    lora = [*RUN, "--finetune", "lora", "--lr", "1e-2", "--data_dir", str(data_dir), "--init_from",
            str(run_dir / "model")]
    train.main([*lora, "--out_dir", str(tmp_path / "first")])
    start, run = tmp_path / "start", tmp_path / "lora"
    shutil.move(tmp_path / "first" / "adapter", start)
    train.main([*lora, "--max_steps", "3", "--adapter", str(start), "--out_dir", str(run)])
    whole = load_file(run / "adapter" / "adapter_model.safetensors")
    other = ["--lora_rank", "4", "--lora_alpha", "64", "--max_steps", "1", "--out_dir", str(tmp_path / "other")]
    train.main([*lora, *other])
    for replaced in (False, True):
        for written in (run / "step-3", run / "adapter", run / "model", start):  # killed after step 2, DIR moved
            shutil.rmtree(written, ignore_errors=True)
        (run / trainer.FINISHED_NAME).unlink()
        if replaced:
            shutil.copytree(tmp_path / "other" / "adapter", start)
        assert train.main([*lora, "--max_steps", "3", "--resume", "--out_dir", str(run)])["step"] == 3
        resumed = load_file(run / "adapter" / "adapter_model.safetensors")
        assert resumed.keys() == whole.keys() and all(torch.equal(resumed[name], whole[name]) for name in whole)


def test_a_failed_save_names_its_cause_and_the_last_checkpoint(data_dir, tmp_path, monkeypatch):
    from storage import checkpoint

    def full_disk(*args: object, **kwargs: object) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598")

    train.main([*RUN, "--max_steps", "1", "--data_dir", str(data_dir), "--out_dir", str(tmp_path)])
    monkeypatch.setattr(checkpoint.dcp, "save", full_disk)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 0))
    with pytest.raises(checkpoint.SaveFailed, match=f"could not save step-2: No space left on device at {tmp_path}; "
                                                    "the last complete checkpoint is step-1"):
        train.main([*RUN, "--data_dir", str(data_dir), "--out_dir", str(tmp_path), "--resume"])
    assert not (tmp_path / "step-2.tmp").exists()


def test_an_unwritable_directory_is_one_line(monkeypatch, tmp_path):
    from training.run_directory import RunLock

    def refuse(*args: object, **kwargs: object) -> int:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(PermissionError, match=f"cannot write in {tmp_path} \\(Permission denied\\); choose another"):
        RunLock(tmp_path).acquire()
