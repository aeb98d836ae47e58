"""Issue 34's exposure items, below the CLI: where the launcher's stores
listen."""
from __future__ import annotations

import os

import psutil
import pytest
import torch.distributed as dist

from megaresil.compat import elastic_stores_listening_on
from megaresil.launch.membership import Membership


def listening_ips() -> set[str]:
    return {c.laddr.ip for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN}


def test_one_node_meets_and_serves_its_workers_on_loopback():
    one = Membership.parse("1", 2, "node7.example:29400", "job", backend="c10d")
    assert one.rendezvous_endpoint == "127.0.0.1:29400"
    assert Membership().rendezvous_endpoint == "127.0.0.1:0"
    assert one.local_addr == Membership().local_addr == "127.0.0.1"
    chosen = Membership.parse(None, 2, None, None, local_addr="10.0.0.9")
    assert chosen.rendezvous_endpoint == "10.0.0.9:0" and chosen.local_addr == "10.0.0.9"


def test_several_nodes_listen_on_the_interface_reaching_the_endpoint(monkeypatch):
    several = Membership.parse("2", 2, "127.0.0.1:29400", "job", backend="c10d")
    assert several.rendezvous_endpoint == "127.0.0.1:29400"
    assert several.local_addr == "127.0.0.1"  # the interface that reaches 127.0.0.1
    routes = {"node1": "10.0.0.5", "trap": "127.0.1.1"}
    monkeypatch.setattr("megaresil.launch.membership.address_towards", lambda host, port: routes[host])
    assert Membership.parse("2", 2, "node1:29400", "job").local_addr == "10.0.0.5"
    # A host name that is loopback only here (Debian's 127.0.1.1): the other
    # nodes could not reach a store there, so torch's own bind stays.
    assert Membership.parse("2", 2, "trap:29400", "job").local_addr is None
    assert Membership.parse("2", 2, "trap:29400", "job", local_addr="10.0.0.9").local_addr \
        == "10.0.0.9"  # --local-addr: the user's word


def test_torchelastic_store_servers_listen_on_their_host_only():
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    before = listening_ips()
    with elastic_stores_listening_on("127.0.0.1"):
        rendezvous = c10d_rendezvous_backend.TCPStore("127.0.0.1", 0, is_master=True,
                                                      multi_tenant=True)
        agent = DynamicRendezvousHandler._create_tcp_store_server(None, "127.0.0.1", 0)
        rendezvous.set("k", "v")
        assert dist.TCPStore("127.0.0.1", agent.port, is_master=False) is not None
        assert listening_ips() - before == {"127.0.0.1"}
    assert c10d_rendezvous_backend.TCPStore is dist.TCPStore  # put back after the launch



@pytest.mark.parametrize("local_world, only_loopback", [("2", True), ("1", False)])
def test_a_rank_hosted_store_listens_on_loopback_when_every_rank_is_on_this_node(
        monkeypatch, local_world, only_loopback):
    """etcd rendezvous and Slurm's one task per rank: rank 0 hosts the store."""
    from megaresil.ports import free_port
    from megaresil.resilience.coordination import launch_store
    from megaresil.worker_env import WorkerEnv

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    before = listening_ips()
    store = launch_store(WorkerEnv.parse({**os.environ, "RANK": "0", "WORLD_SIZE": "2"}))
    store.set("k", "v")
    opened = listening_ips() - before
    assert (opened == {"127.0.0.1"}) is only_loopback, opened

# --- declared sizes against the safetensors headers (item 3a) ---------------------


def tiny_gpt2_dir(directory, n_positions: int = 64, **config_changes):
    """A 2-layer GPT-2 as save_pretrained writes it, then config.json edited."""
    import json

    import transformers

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=300,
                                     n_positions=n_positions, bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(directory)
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config_changes}))
    return directory


def test_a_million_declared_layers_are_refused_from_the_headers(cli_main, tmp_path, monkeypatch):
    from megaresil.checkpoint.hf import mapping as hf

    hf_dir = tiny_gpt2_dir(tmp_path / "hf", n_layer=1_000_000)
    mapped = []
    monkeypatch.setattr(hf, "hf_mapping", lambda cfg: mapped.append(cfg) or {})
    result = cli_main("convert", "--from-hf", str(hf_dir), str(tmp_path / "out"), check=False)
    assert result.returncode == 1 and not mapped  # refused before any name map is built
    line, = result.stderr.strip().splitlines()
    assert str(hf_dir / "config.json") in line and "model.safetensors" in line
    assert "n_layer=1000000 but the weights hold layers 0-1 (2 in all)" in line
    assert not (tmp_path / "out").exists()


def test_a_declared_vocabulary_the_embedding_lacks_is_refused(tmp_path):
    from megaresil.checkpoint.format import CheckpointError
    from megaresil.checkpoint.hf.io import hf_model_keys

    hf_dir = tiny_gpt2_dir(tmp_path / "hf", vocab_size=10**12, n_embd=32)
    with pytest.raises(CheckpointError, match=r"vocab_size=1000000000000 but "
                       r"transformer.wte.weight has shape \[300, 32\]"):
        hf_model_keys(hf_dir)
    assert hf_model_keys(tiny_gpt2_dir(tmp_path / "good"))[0]["num_layers"] == 2


def test_a_truncated_config_json_is_named(tmp_path):
    from megaresil.checkpoint.format import CheckpointError
    from megaresil.checkpoint.hf.io import hf_model_keys

    hf_dir = tiny_gpt2_dir(tmp_path / "hf")
    (hf_dir / "config.json").write_text('{"n_layer": 2, "vocab')
    with pytest.raises(CheckpointError, match=f"{hf_dir / 'config.json'} is not valid JSON"):
        hf_model_keys(hf_dir)


# --- one JSON Lines record bounded (item 3c) --------------------------------------


def test_a_record_over_the_limit_is_refused_with_its_size(cli_main, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    record = json_line("x" * 5000)
    corpus.write_text(json_line("small") + record + json_line("after"))
    args = ("data", "prepare", "--input", str(corpus), "--output", str(tmp_path / "out"),
            "--tokenizer", "byte", "--workers", "1")
    refused = cli_main(*args, "--max-record-bytes", "4096", check=False)
    assert refused.returncode == 2
    line, = [x for x in refused.stderr.splitlines() if x.startswith("megaresil: error")]
    assert f"{corpus}:2 is a record of {len(record):,} bytes" in line
    assert "limit of 4,096 bytes" in line and "--max-record-bytes" in line
    assert "prepared 3 documents" in cli_main(*args, "--max-record-bytes", "8192").stdout


def test_the_record_bound_reads_no_more_than_the_limit(tmp_path, monkeypatch):
    from megaresil.config import ConfigError
    from megaresil.data import corpus

    path = tmp_path / "big.jsonl"
    record = json_line("y" * 100_000)
    path.write_text(record)
    reads = []
    real_open = open

    class Recording:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def readline(self, size=-1):
            line = self.handle.readline(size)
            reads.append(len(line))
            return line

    monkeypatch.setattr(corpus, "open", lambda *a, **k: Recording(real_open(*a, **k)),
                        raising=False)
    with pytest.raises(ConfigError, match=f"is a record of {len(record):,} bytes"):
        list(corpus.json_lines_documents(path, "text", max_record_bytes=1000))
    assert reads[0] == 1001  # the first read stops past the limit; the rest only counts


def json_line(text: str) -> str:
    import json

    return json.dumps({"text": text}) + "\n"


# --- a malformed tokenizer is a recipe error, fatal wherever raised (item 4) ------


def test_a_malformed_tokenizer_json_is_a_fatal_recipe_error_naming_it(tmp_path):
    from megaresil.config import ConfigError
    from megaresil.data.tokenizer import hf_tokenizer_from_path
    from megaresil.errors import is_fatal

    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "trunc')
    with pytest.raises(ConfigError) as caught:
        hf_tokenizer_from_path(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(caught.value)
    assert is_fatal(caught.value)  # no restart retries it


def test_convert_from_hf_carries_the_tokenizer_to_a_later_export(cli_main, tmp_path):
    from megaresil.data.tokenizer import ByteTokenizer

    hf_dir = tiny_gpt2_dir(tmp_path / "hf", n_positions=256)
    ByteTokenizer().hf_tokenizer().save(str(hf_dir / "tokenizer.json"))
    cli_main("convert", "--from-hf", str(hf_dir), str(tmp_path / "imported"))
    cli_main("convert", str(tmp_path / "imported"), "--to-hf", str(tmp_path / "exported"))
    exported = (tmp_path / "exported" / "tokenizer.json").read_text()
    assert exported == (hf_dir / "tokenizer.json").read_text()


def test_from_hf_names_a_malformed_tokenizer_config_before_any_worker(tmp_path):
    from megaresil.config import ConfigError
    from megaresil.data.tokenizer import ByteTokenizer
    from megaresil.launch.from_hf import resolve_from_hf
    from tests.harness.cli import ROOT

    hf_dir = tiny_gpt2_dir(tmp_path / "hf", n_positions=256)
    ByteTokenizer().hf_tokenizer().save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text('{"eos_token": ')
    recipe = str(ROOT / "recipes" / "gpt-tiny.yaml")
    with pytest.raises(ConfigError, match=f"--from-hf: {hf_dir / 'tokenizer_config.json'} is not"):
        resolve_from_hf(hf_dir, recipe, [])
    resolve_from_hf(hf_dir, recipe, ["data.tokenizer=byte"])  # one the user chose instead


def test_several_nodes_without_a_job_id_are_refused():
    """Each agent would otherwise name the job after its own pid, and the
    nodes would wait for one another for good."""
    from megaresil.config import ConfigError

    with pytest.raises(ConfigError, match=r"^--rdzv-id: .*Fix: add --rdzv-id ID"):
        Membership.parse("2", 4, "node0:29400", None)
    assert Membership.parse("1", 4, "node0:29400", None).max_nodes == 1
