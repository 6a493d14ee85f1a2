from verispec.stopping import TextAssembler

VOCAB = {0: "ab", 1: "c", 2: "STO", 3: "P", 4: "d", 5: "\ufffd"}


def decode(ids):
    return "".join(VOCAB[i] for i in ids)


def test_releases_all_text_without_stop_strings():
    text = TextAssembler(decode)
    text.add([0, 1])
    assert text.release() == "abc"
    text.add([4])
    assert text.release(final=True) == "d"


def test_stop_string_across_tokens_is_never_released():
    text = TextAssembler(decode, ("STOP",))
    released = ""
    for token in [0, 1, 2, 3, 4]:
        text.add([token])
        released += text.release()
    assert text.stopped
    assert released == "abc"
    assert text.text == "abc"
    assert text.token_ids == [0, 1, 2, 3]  # the token that completed the stop string is kept, nothing after


def test_partial_stop_prefix_is_released_once_it_cannot_match():
    text = TextAssembler(decode, ("STOP",))
    text.add([0, 2])
    assert text.release() == "ab"  # "STO" may still become a stop string
    text.add([4])
    assert text.release(final=True) == "STOd"


def test_unfinished_utf8_is_held_back():
    text = TextAssembler(decode)
    text.add([0, 5])
    assert text.release() == "ab"
