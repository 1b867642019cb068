"""The attention interface and registry: an attention type written outside the package
(examples/sliding_window_attention.py, registered with one line) builds, trains, generates through the KV cache
exactly as prefill does, and is refused with a clear error when its options are impossible. Tolerances: float64,
1e-12 (same maths, other op order)."""

from __future__ import annotations

import pytest
import torch

from model import Transformer
from modeling.attention import AttentionLayer, FullAttention
from modeling.config import ModelConfig, attention_class


def test_registered_types_implement_the_protocol(swa):
    for name in ("full", "nsa", "swa"):
        config = ModelConfig.from_preset("tiny", attention_type=name)
        layer = attention_class(name)(config)
        assert isinstance(layer, AttentionLayer), name
        assert attention_class(name).flops_per_token(config, 64) > 0
    assert attention_class("full") is FullAttention


def test_unknown_type_and_bad_options_name_the_fix(swa):
    with pytest.raises(ValueError, match="registered: .*'swa'.*register_attention"):
        ModelConfig.from_preset("tiny", attention_type="ring")
    with pytest.raises(ValueError, match=r"attention_options\['window'\]"):
        ModelConfig.from_preset("tiny", attention_type="swa", attention_options={"window": 0})


def test_swa_matches_a_dense_band_mask_and_decodes_like_prefill(swa):
    config = ModelConfig.from_preset("tiny", attention_type="swa", attention_options={"window": 5})
    model = Transformer(config).to(torch.float64).eval()
    ids = torch.randint(0, config.vocab_size, (2, 40))
    with torch.no_grad():
        full = model(ids).logits  # (2, 40, V)
        # changing token t changes nothing before t, and nothing from t + window on in the first layer's reach
        ids2 = ids.clone()
        ids2[:, 20] = (ids2[:, 20] + 1) % config.vocab_size
        torch.testing.assert_close(model(ids2).logits[:, :20], full[:, :20], rtol=0, atol=0)
        model.setup_kv_cache(2, 40)
        steps = [(0, 7), (7, 20)] + [(t, t + 1) for t in range(20, 40)]
        decoded = torch.cat([model(ids[:, a:b], start_pos=a).logits for a, b in steps], dim=1)
        model.clear_kv_cache()
    torch.testing.assert_close(decoded, full, rtol=0, atol=1e-12)
    out = model.generate(ids[:1, :10], max_new_tokens=12, temperature=0)
    with torch.no_grad():
        assert torch.equal(model(out[:, :-1]).logits[:, 9:].argmax(-1), out[:, 10:])


def test_swa_trains_through_train_main(swa, data_dir, tmp_path, capsys):
    """The test-only type runs the whole pipeline: --attention_type accepts it, it trains, checkpoints, exports
    in the project's layout (no Hugging Face equivalent) and samples through its KV cache."""
    import train
    from storage.weights import load_model

    metrics = train.main(["--model_size", "tiny", "--attention_type", "swa", "--context_length", "32",
                          "--batch_size", "2", "--max_steps", "2", "--warmup_steps", "1", "--sample_tokens", "5",
                          "--data_dir", str(data_dir), "--out_dir", str(tmp_path)])
    assert metrics["step"] == 2 and (tmp_path / "step-2").is_dir()
    out = capsys.readouterr().out
    assert "attention_type 'swa' has no Hugging Face equivalent" in out and "--- sample (5 tokens" in out
    assert load_model(tmp_path / "model").config.attention_type == "swa"


def test_mfu_flops_come_from_the_attention_type(swa):
    """monitor.flops_per_token = 6 x (FFN + output weights) + n_layers x the type's own count."""
    from training.monitor import flops_per_token

    for name in ("full", "nsa", "swa"):
        config = ModelConfig.from_preset("tiny", attention_type=name)
        dense = 6 * (config.n_layers * 3 * config.dim * config.ffn_dim + config.vocab_size * config.dim)
        want = dense + config.n_layers * attention_class(name).flops_per_token(config, 1024)
        assert flops_per_token(config, 1024) == want
    short, long = (attention_class("swa").flops_per_token(ModelConfig.from_preset("tiny", attention_type="swa"), t)
                   for t in (1024, 4096))
    assert short == long  # a sliding window: cost per token independent of T


def test_plugins_register_types_modes_and_tasks_from_the_command_line(data_dir, tmp_path, capsys):
    """--plugin MODULE imports a module and calls its register(), before the options are read: train.py trains an
    attention type the repository does not register, profile_memory.py estimates it, eval.py runs a task of
    another plugin on the result; a module that cannot be imported, or has no register(), is one line."""
    import eval as eval_cli
    import profile_memory
    import train
    from evaluation import registry
    from modeling import config
    from training import options
    from training.cli import load_plugins

    registries = (config.ATTENTION_TYPES, registry.EVAL_TASKS, options.FINETUNE_MODES)
    before = [set(r) for r in registries]
    swa = ["--plugin", "examples.sliding_window_attention"]
    try:
        train.main([*swa, "--attention_type", "swa", "--model_size", "tiny", "--context_length", "32", "--batch_size",
                    "2", "--max_steps", "1", "--sample_tokens", "0", "--data_dir", str(data_dir), "--out_dir",
                    str(tmp_path / "run")])
        profile_memory.main([*swa, "--attention_type", "swa", "--model_size", "tiny", "--context_length", "64"])
        assert "swa" in capsys.readouterr().out
        result = eval_cli.main([str(tmp_path / "run" / "model"), *swa, "--plugin", "examples.eval_task", "--tasks",
                                "induction", "--lengths", "16", "--samples", "2"])
        assert "induction" in result
    finally:  # what the plugins registered goes again
        for names, kept in zip(registries, before, strict=True):
            for name in set(names) - kept:
                del names[name]
    file = tmp_path / "my_plugin.py"  # a file, with a dataclass (which looks its module up in sys.modules)
    file.write_text("import dataclasses\n\n\n@dataclasses.dataclass\nclass Options:\n    window: int = 8\n\n\n"
                    "def register() -> None:\n    from training.options import register_finetune\n\n"
                    "    register_finetune('norms2', 'examples.norm_finetune:NormsOnly')\n")
    try:
        load_plugins(["--model_size", "tiny", "--plugin", str(file)])
        assert "norms2" in options.FINETUNE_MODES
    finally:
        options.FINETUNE_MODES.pop("norms2", None)
    broken = tmp_path / "broken.py"
    broken.write_text("def register() -> None:\n    raise RuntimeError('no GPU here')\n")
    for plugin, message in (("no.such.module", "cannot import it"), ("examples", "has no register() to call"),
                            (str(broken), "its register() failed (RuntimeError: no GPU here)")):
        with pytest.raises(SystemExit) as refusal:
            train.main(["--plugin", plugin])
        assert refusal.value.code == 2 and message in capsys.readouterr().err
