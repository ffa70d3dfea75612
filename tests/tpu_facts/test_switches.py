"""The scoped on/off switch: on inside its block only, per thread, restored when the block raises."""

from __future__ import annotations

import threading

import pytest

from tpu_facts.switches import Switch


def test_on_inside_the_block_only_and_nested_blocks_restore_it() -> None:
    switch = Switch("test_switch")
    assert not switch.is_on()
    with switch.on():
        assert switch.is_on()
        with switch.on():
            assert switch.is_on()
        assert switch.is_on()
    assert not switch.is_on()


def test_a_raising_block_turns_it_back_off() -> None:
    switch = Switch("test_switch")
    with pytest.raises(KeyError), switch.on():
        raise KeyError("inside")
    assert not switch.is_on()


def test_another_thread_does_not_see_it() -> None:
    switch = Switch("test_switch")
    seen = []
    with switch.on():
        thread = threading.Thread(target=lambda: seen.append(switch.is_on()))
        thread.start()
        thread.join()
    assert seen == [False]
