import argparse
import dataclasses

import pytest

from kvfs.chunkserver.config import ChunkserverConfig
from kvfs.config import GiB, MiB, add_flags, load, parse_size


@pytest.mark.parametrize("text,value", [("10GiB", 10 * GiB), ("512MiB", 512 * MiB), ("1.5MB", 1_500_000),
                                        ("4096", 4096), (" 2 kib ", 2048), (7, 7)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "ten", "5 parsecs", "-1GiB"])
def test_parse_size_rejects_garbage(text):
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


def test_precedence_flags_over_env_over_toml_over_defaults(tmp_path):
    toml = tmp_path / "kvfs.toml"
    toml.write_text('[chunkserver]\nid = "from-toml"\ncapacity = "3GiB"\nfailure_domain = "rack-t"\n'
                    'uring_entries = 64\n')
    env = {"KVFS_CHUNKSERVER_CAPACITY": "2GiB", "KVFS_CHUNKSERVER_FAILURE_DOMAIN": "rack-e"}
    cfg = load(ChunkserverConfig, "chunkserver", {"config": str(toml), "failure_domain": "rack-f"}, env)
    assert cfg.id == "from-toml"                # toml over default
    assert cfg.capacity == 2 * GiB              # env over toml
    assert cfg.failure_domain == "rack-f"       # flag over env
    assert cfg.uring_entries == 64
    assert cfg.listen == ChunkserverConfig().listen


def test_config_file_from_env(tmp_path):
    toml = tmp_path / "k.toml"
    toml.write_text('[chunkserver]\nio_mode = "buffered"\n')
    assert load(ChunkserverConfig, "chunkserver", {}, {"KVFS_CONFIG": str(toml)}).io_mode == "buffered"


def test_unknown_toml_key_is_an_error(tmp_path):
    toml = tmp_path / "k.toml"
    toml.write_text('[chunkserver]\ncapacty = "1GiB"\n')
    with pytest.raises(ValueError, match="unknown keys.*capacty"):
        load(ChunkserverConfig, "chunkserver", {"config": str(toml)}, {})


@pytest.mark.parametrize("field,value,match", [("io_mode", "fast", "io_mode must be one of"),
                                               ("io_engine", "aio", "io_engine must be one of"),
                                               ("max_chunk_size", "1GiB", "max_chunk_size")])
def test_bad_values_are_refused_with_the_field_named(field, value, match):
    with pytest.raises(ValueError, match=match):
        load(ChunkserverConfig, "chunkserver", {field: value}, {})


def test_every_field_has_a_flag():
    parser = argparse.ArgumentParser()
    add_flags(parser, ChunkserverConfig)
    args = parser.parse_args(["--data-dir", "/d", "--capacity", "1GiB", "--io-engine", "preadv"])
    cfg = load(ChunkserverConfig, "chunkserver", vars(args), {})
    assert (cfg.data_dir, cfg.capacity, cfg.io_engine) == ("/d", GiB, "preadv")


@pytest.mark.parametrize("part", ["chunkserver", "metaserver"])
def test_help_lists_every_flag_with_its_text(part, capsys):
    """`kvfs-metaserver --help` once died in argparse's %-formatting of a help text
    that said "90%"; every server's --help prints every flag and exits 0."""
    from kvfs.chunkserver.main import main as chunkserver_main
    from kvfs.metaserver.config import MetaserverConfig
    from kvfs.metaserver.main import main as metaserver_main

    main, cls = {"chunkserver": (chunkserver_main, ChunkserverConfig), "metaserver": (metaserver_main, MetaserverConfig)}[part]
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    shown = capsys.readouterr().out
    for f in dataclasses.fields(cls):
        assert "--" + f.name.replace("_", "-") in shown


def test_shipped_default_config_is_the_defaults():
    import pathlib

    from kvfs.cli.main import default_config
    from kvfs.metaserver.config import MetaserverConfig

    sample = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "kvfs.toml"
    assert load(ChunkserverConfig, "chunkserver", {"config": str(sample)}, {}) == ChunkserverConfig()
    assert load(MetaserverConfig, "metaserver", {"config": str(sample)}, {}) == MetaserverConfig()
    # every key, with its help: regenerate with `kvfs config > deploy/kvfs.toml`
    assert sample.read_text() == default_config(), "deploy/kvfs.toml is stale: run `kvfs config > deploy/kvfs.toml`"


@pytest.mark.parametrize("value,text", [(10 * GiB, '"10GiB"'), (64 * MiB, '"64MiB"'), (1000, '"1000"'), (0, '"0"')])
def test_sizes_are_written_as_people_write_them(value, text):
    import dataclasses

    from kvfs.config import render_toml, size_field

    cls = dataclasses.make_dataclass("C", [("n", int, size_field(value, "a size"))])
    assert render_toml({"s": cls}).splitlines()[-1] == f"n = {text}"
    assert load(cls, "s", {}, {}).n == value


@pytest.mark.parametrize("seconds,text", [(0.5, '"500ms"'), (2.0, '"2s"'), (600.0, '"10m"'), (259200.0, '"3d"'),
                                          (1.5, '"1.5s"')])
def test_durations_round_trip_through_the_rendered_file(tmp_path, seconds, text):
    import dataclasses

    from kvfs.config import duration_field, render_toml

    cls = dataclasses.make_dataclass("C", [("t", float, duration_field(seconds, "a duration"))])
    rendered = render_toml({"s": cls})
    assert rendered.splitlines()[-1] == f"t = {text}"
    path = tmp_path / "c.toml"
    path.write_text(rendered)
    assert load(cls, "s", {"config": str(path)}, {}).t == seconds


@pytest.mark.parametrize("text,seconds", [("500ms", 0.5), ("10s", 10), ("5m", 300), ("3d", 259200), ("2", 2)])
def test_parse_duration(text, seconds):
    from kvfs.config import parse_duration

    assert parse_duration(text) == seconds


def test_ttl_classes_and_default_class_checked():
    from kvfs.metaserver.config import MetaserverConfig, parse_ttl_classes

    assert parse_ttl_classes("agent=3d, chat=7d") == {"agent": 259200, "chat": 604800}
    with pytest.raises(ValueError, match="name=duration"):
        parse_ttl_classes("agent")
    with pytest.raises(ValueError, match="default_ttl_class"):
        MetaserverConfig(ttl_classes="agent=3d")
