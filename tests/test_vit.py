"""The ViT with pluggable feed-forward blocks and the ViT experiment (docs/reference.md §8): shapes,
the RCDL FFN's gradients and growth, the shared initialisation, and a tiny end-to-end run."""

import csv
import json
import math

import pytest
import torch
import torch.nn.functional as F

from rcdl.app.experiments.vit import MODELS, ViTConfig, build_model, load_data, run_vit
from rcdl.nn.gates import DistanceGate
from rcdl.nn.hybrid import hybrid_layers
from rcdl.nn.vit import PatchEmbedding, RCDLFeedForward, ViT, mlp_vit, rcdl_vit
from rcdl.optim.entry_adam import EntryAdam
from rcdl.optim.grower import Grower

SMALL = {"patch_size": 8, "width": 16, "depth": 2, "heads": 2}


def _images(n, seed=0):
    return torch.randn(n, 3072, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- the model


def test_patches_are_hwc_blocks_of_the_image():
    embed = PatchEmbedding(32, 3, 8, width=5)
    with torch.no_grad():
        embed.proj.weight.zero_()
        embed.proj.weight[:, :192] = torch.eye(192)[:5]  # read the patch's first 5 numbers
        embed.proj.bias.zero_()
    x = torch.arange(2 * 3072, dtype=torch.float32).view(2, 3072)
    tokens = embed(x)  # (2, 16, 5)
    image = x.view(2, 32, 32, 3)
    # patch (row 1, column 2) starts at pixel (8, 16); HWC order inside the patch
    assert torch.equal(tokens[:, 1 * 4 + 2], image[:, 8, 16:18].reshape(2, 6)[:, :5])
    with pytest.raises(ValueError, match=r"expected flattened HWC images \(B, 3072\)"):
        embed(torch.zeros(2, 3, 32, 32))
    with pytest.raises(ValueError, match="patch_size 5 does not divide the image size 32"):
        PatchEmbedding(32, 3, 5, width=4)


@pytest.mark.parametrize("pool", ["cls", "mean"])
@pytest.mark.parametrize("kind", ["mlp", "rcdl"])
def test_logits_shape(kind, pool):
    model = mlp_vit(pool=pool, **SMALL) if kind == "mlp" else rcdl_vit(temperature=1.0,
                                                                      pool=pool, **SMALL)
    assert model.pos.shape == (1, 16 + (pool == "cls"), 16)
    assert model(_images(3)).shape == (3, 10)
    model.eval()
    assert model(_images(3)).shape == (3, 10)


def test_bad_settings_name_the_problem():
    with pytest.raises(ValueError, match="pool must be one of"):
        mlp_vit(pool="max", **SMALL)
    with pytest.raises(ValueError, match="3 heads do not divide the width 16"):
        mlp_vit(**{**SMALL, "heads": 3})
    with pytest.raises(ValueError, match="give tau or trigger, not both"):
        rcdl_vit(temperature=1.0, tau=1.0, trigger=DistanceGate(1.0), **SMALL)
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        RCDLFeedForward(8, temperature=1.0, scale=0.0)


def test_both_models_share_their_initial_attention_embeddings_and_head():
    torch.manual_seed(3)
    a = mlp_vit(**SMALL)
    torch.manual_seed(3)
    b = rcdl_vit(temperature=1.0, **SMALL)
    shared = {k: v for k, v in a.state_dict().items() if ".ffn." not in k}
    other = b.state_dict()
    assert shared and all(torch.equal(v, other[k]) for k, v in shared.items())


def test_rcdl_queries_have_norm_sqrt_d_and_default_gate_is_relative_to_it():
    ffn = RCDLFeedForward(16, temperature=1.0)
    assert ffn.layer.trigger == DistanceGate(4.0)
    assert (ffn.layer.rule.eta, ffn.layer.rule.beta) == (10.0, 0.3)
    u = torch.randn(2, 5, 16) * 7 + 3
    assert torch.allclose(ffn.norm(u).norm(dim=-1), torch.full((2, 5), 4.0), atol=1e-4)
    assert torch.allclose(RCDLFeedForward(16, temperature=1.0, scale=0.5, seed=0)(u),
                          0.5 * RCDLFeedForward(16, temperature=1.0, seed=0)(u))


def test_gradients_reach_attention_embeddings_and_entries():
    torch.manual_seed(0)
    model = rcdl_vit(temperature=1.0, **SMALL)
    F.cross_entropy(model(_images(4)), torch.arange(4)).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    for _, layer in hybrid_layers(model):
        keys, values, weights = layer.entry_leaves()
        assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (keys, values, weights))


def test_tokens_write_gated_entries_and_adam_trains_everything():
    torch.manual_seed(0)
    model = rcdl_vit(temperature=1.0, tau=0.0, initial_entries=4, **SMALL)  # τ = 0: all write
    optimizer, grower = EntryAdam(model, lr=1e-3), Grower(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = _images(3), torch.tensor([0, 1, 2])
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
    grower.step()
    tokens = 3 * 17  # 16 patches and the class token per image, every one a new entry
    for _, layer in hybrid_layers(model):
        assert len(layer.store) == 4 + tokens and grower.growth[layer.name].written == tokens
        assert not torch.equal(layer.store.keys[:4], before[f"{layer.name}.store.keys"][:4])
    assert not torch.equal(model.blocks[0].attn.qkv.weight, before["blocks.0.attn.qkv.weight"])

    # the same tokens again, with a gate wider than any distance between queries (2√d):
    # refused, and samples of one batch do not gate each other
    for _, layer in hybrid_layers(model):
        layer.trigger = DistanceGate(2 * math.sqrt(16) + 1)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
    grower.step()
    for _, layer in hybrid_layers(model):
        assert len(layer.store) == 4 + tokens and int(grower.growth[layer.name].refused) == tokens


def test_a_query_farther_than_tau_writes_and_a_nearer_one_does_not():
    torch.manual_seed(0)
    ffn = RCDLFeedForward(8, temperature=1.0, initial_entries=0, trigger=DistanceGate(1.0))
    grower = Grower(ffn)
    with torch.no_grad():  # one stored key at e_0 · √8
        key = torch.zeros(1, 8)
        key[0, 0] = math.sqrt(8)
        ffn.layer.store.append(key, torch.zeros(1, 8), torch.ones(1))
    near = key + torch.tensor([[0.0, 0.9] + [0.0] * 6])  # after RMSNorm, ‖q − k‖ ≈ 0.9 < 1
    far = torch.zeros(1, 8)
    far[0, 1] = 1.0  # orthogonal: ‖q − k‖ = 4 > 1
    ffn(torch.stack([near, far]).view(2, 1, 8)).sum().backward()
    grower.step()
    growth = grower.growth[ffn.layer.name]
    assert (growth.written, int(growth.refused)) == (1, 1)
    assert torch.allclose(ffn.layer.store.keys[1], ffn.norm(far)[0])


# --------------------------------------------------------------------------- the experiment


def _tiny(data_dir, **overrides):
    settings = {"train_size": 48, "test_size": 24, "eval_every": 2, "patch_size": 8,
                "data_dir": data_dir, "device": "cpu"}  # fmt: skip
    return ViTConfig.quick(**{**settings, **overrides})


@pytest.fixture(scope="module")
def run(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "run"
    folder, summary = run_vit(_tiny(data_dir), out=out, progress=False, download=False)
    assert folder.path == out
    return out, summary


def test_run_folder_holds_the_results(run, data_dir):
    out, summary = run
    for name in ("config.json", "environment.json", "metrics.jsonl", "summary.json",
                 "results.md", "results.csv", "vit.png"):  # fmt: skip
        assert (out / name).is_file(), name
    assert (out / "vit.png").read_bytes().startswith(b"\x89PNG")
    saved = json.loads((out / "config.json").read_text())
    assert ViTConfig.from_dict(saved) == _tiny(data_dir)
    assert json.loads((out / "summary.json").read_text())["complete"] is True
    assert summary["complete"] is True


def test_both_models_are_trained_and_rcdl_reports_its_stores(run):
    out, summary = run
    mlp, rcdl = summary["runs"]
    assert (mlp["model"], rcdl["model"]) == ("mlp", "rcdl")
    for r in (mlp, rcdl):
        assert [h["step"] for h in r["history"]] == [0, 2, 3] and r["samples"] == 48
    assert "layers" not in mlp and mlp["entries"] is None
    assert summary["tokens_per_image"] == 17 and summary["tau"] == pytest.approx(math.sqrt(32))
    assert len(rcdl["layers"]) == 2
    for layer in rcdl["layers"]:
        assert layer["entries"] == 16 + layer["written"] and layer["possible"] == 48 * 17
        assert layer["written"] + layer["refused"] == 48 * 17
    assert rcdl["entries"] == sum(x["entries"] for x in rcdl["layers"])
    assert [s["entries_per_layer"] for s in rcdl["sizes"]][0] == [16, 16]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r["model"] for r in records} == set(MODELS)
    assert all("entries_per_layer" in r for r in records if r["model"] == "rcdl")


def test_tables(run):
    out, summary = run
    table = (out / "results.md").read_text()
    assert "| ViT, MLP feed-forward blocks |" in table and "| 48.4 % |" in table
    assert "| ViT, RCDL feed-forward blocks |" in table and "| 54.4 % |" in table
    assert "distance gate τ = 1 √d = 5.66" in table and "Machine:" in table
    rows = list(csv.DictReader((out / "results.csv").read_text().splitlines()))
    assert [r["model"] for r in rows] == ["mlp", "rcdl"]
    assert rows[0]["entries"] == "" and len(rows[1]["entries_per_layer"].split()) == 2
    assert [r["model"] for r in summary["rows"]] == ["mlp", "rcdl"]


def test_same_config_same_numbers(data_dir, tmp_path, run):
    _, reference = run
    _, summary = run_vit(_tiny(data_dir, models=("rcdl",)), out=tmp_path / "r", progress=False,
                         download=False)
    assert summary["runs"][0]["history"] == reference["runs"][1]["history"]
    assert summary["runs"][0]["layers"] == reference["runs"][1]["layers"]


def test_build_model_learners(data_dir):
    cfg = _tiny(data_dir)
    model, optimizer, grower = build_model("mlp", 0, cfg)
    assert isinstance(model, ViT) and isinstance(optimizer, torch.optim.Adam) and grower is None
    model, optimizer, grower = build_model("rcdl", 0, cfg)
    assert isinstance(optimizer, EntryAdam) and len(grower.layers) == 2
    assert all(layer.trigger == DistanceGate(cfg.tau) for layer in grower.layers)
    with pytest.raises(ValueError, match="unknown model 'resnet'; known: mlp, rcdl"):
        build_model("resnet", 0, cfg)


def test_quick_paper_and_saved_configs():
    quick = ViTConfig.quick()
    assert (quick.train_size, quick.width, quick.depth) == (500, 32, 2)
    paper = ViTConfig.paper()
    assert (paper.train_size, paper.test_size, paper.patch_size) == (None, None, 4)
    assert paper.tokens == 65 and math.sqrt(paper.width) / paper.temperature == pytest.approx(4)
    saved = json.loads(json.dumps(ViTConfig(seeds=[0, 3]).__dict__))
    assert ViTConfig.from_dict(saved) == ViTConfig(seeds=(0, 3))
    with pytest.raises(ValueError, match=r"unknown settings \['blocks'\]"):
        ViTConfig.from_dict({"blocks": 3})


@pytest.mark.parametrize(
    ("settings", "message"),
    [({"models": ("mlp", "mlp")}, "ViTConfig: models must not repeat"),
     ({"models": ("cnn",)}, r"ViTConfig: unknown models \['cnn'\]; known: mlp, rcdl"),
     ({"models": ()}, "ViTConfig: give at least one of models: mlp, rcdl"),
     ({"patch_size": 5}, "patch_size must divide 32, got 5"),
     ({"heads": 3}, r"heads \(3\) must divide width \(64\)"),
     ({"temperature": 0.0}, "temperature must be a finite number > 0"),
     ({"tau_rel": -1.0}, "tau_rel must be a finite number >= 0"),
     ({"train_size": 0}, "train_size must be an int >= 1, got 0"),
     ({"pool": "max"}, "pool must be one of"),
     ({"initial_entries": -1}, "initial_entries must be an int >= 0, got -1"),
     ({"seeds": (0, -1)}, "each seed must be an int >= 0, got -1"),
     ({"device": "tpu"}, "device must be one of")],
    ids=["repeated-model", "unknown-model", "no-model", "patch", "heads", "temperature",
         "tau", "empty-subset", "pool", "initial-entries", "seed", "device"],
)  # fmt: skip
def test_bad_config_names_the_problem(settings, message):
    with pytest.raises(ValueError, match=message):
        ViTConfig(**settings)


def test_subset_larger_than_the_data_is_refused(data_dir, tmp_path):
    with pytest.raises(ValueError, match="train_size 100 is larger than the 64 images"):
        load_data(_tiny(data_dir, train_size=100), download=False)
    data = load_data(_tiny(data_dir, train_size=40), download=False)
    with pytest.raises(ValueError, match="40 train / 24 test images, the config asks for 48"):
        run_vit(_tiny(data_dir), data=data, out=tmp_path / "r", progress=False)
    assert not (tmp_path / "r").exists()


def test_cli_flags_reach_the_config(tmp_path, monkeypatch):
    """`rcdl reproduce vit` maps its flags onto ViTConfig; --quick and --paper exclude."""
    from rcdl.app import cli, runner

    seen = {}
    monkeypatch.setattr(runner, "run_experiment", lambda spec, cfg, **kw: seen.update(cfg=cfg))
    base = ["reproduce", "vit", "--data-dir", str(tmp_path), "--device", "cpu",
            "--no-progress"]
    assert cli.main([*base, "--quick", "--tau-rel", "1.2", "--models", "rcdl"]) == 0
    assert (seen["cfg"].tau_rel, seen["cfg"].models, seen["cfg"].train_size) == (1.2,
                                                                                ("rcdl",), 500)
    with pytest.raises(SystemExit):
        cli.main([*base, "--quick", "--paper"])
