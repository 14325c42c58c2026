"""TensorRT-LLM's request tensors -> kiln requests, without a server (pure numpy)."""
import numpy as np
import pytest

from kiln import constants as names
from kiln.errors import RequestError
from kiln.triton_repo.engine_request import decode_words, parse_engine_request
from kiln.triton_repo.preprocessing import word_list_tensor


def request(**tensors):
    arrays = {k: np.asarray(v).reshape(1, -1) if np.ndim(v) < 2 else np.asarray(v) for k, v in tensors.items()}
    return lambda name: arrays.get(name)


BASE = {names.INPUT_IDS: np.array([5, 6, 7, 0, 0], dtype=np.int32), names.INPUT_LENGTHS: 3,
        names.REQUEST_OUTPUT_LEN: 9}


def test_word_lists_round_trip_in_tensorrt_llms_format():
    words = [[11, 12], [13], [14, 15, 16]]
    tensor = word_list_tensor(words)
    assert tensor.tolist() == [[[11, 12, 13, 14, 15, 16], [2, 3, 6, -1, -1, -1]]]
    assert decode_words(tensor) == ((11, 12), (13,), (14, 15, 16))
    assert word_list_tensor([]).shape == (1, 2, 0) and decode_words(word_list_tensor([])) == ()


def test_malformed_word_lists_are_refused():
    with pytest.raises(RequestError, match="shape \\[2, N\\]"):
        decode_words(np.zeros((1, 3, 4), dtype=np.int32))
    with pytest.raises(RequestError, match="not increasing"):
        decode_words(np.array([[[1, 2, 3], [2, 1, -1]]], dtype=np.int32))


def test_defaults_and_lengths():
    ids, params, options = parse_engine_request(request(**BASE))
    assert ids == [5, 6, 7] and params.max_tokens == 9 and params.greedy and not options.streaming
    with pytest.raises(RequestError, match="input_lengths 9"):
        parse_engine_request(request(**{**BASE, names.INPUT_LENGTHS: 9}))
    with pytest.raises(RequestError, match="request_output_len"):
        parse_engine_request(request(**{names.INPUT_IDS: [1, 2]}))


def test_every_sampling_input_reaches_the_params():
    _, p, o = parse_engine_request(request(**BASE, **{
        names.TEMPERATURE: np.float32(0.5), names.RUNTIME_TOP_K: 4, names.RUNTIME_TOP_P: np.float32(0.75),
        names.SEED: np.uint64(9), names.END_ID: 2, names.MIN_TOKENS: 3, names.REPETITION_PENALTY: np.float32(1.25),
        names.PRESENCE_PENALTY: np.float32(0.5), names.FREQUENCY_PENALTY: np.float32(0.25),
        names.STOP_WORDS_LIST: word_list_tensor([[1, 2]]), names.BAD_WORDS_LIST: word_list_tensor([[3]]),
        names.EMBEDDING_BIAS: np.zeros(4, dtype=np.float32), names.RETURN_LOG_PROBS: True,
        names.STREAMING: True, names.EXCLUDE_INPUT_IN_OUTPUT: True, names.PAD_ID: 0}))
    assert (p.temperature, p.top_k, p.top_p, p.seed, p.end_id, p.min_tokens) == (0.5, 4, 0.75, 9, 2, 3)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.25, 0.5, 0.25)
    assert p.stop_words == ((1, 2),) and p.bad_words == ((3,),) and p.embedding_bias == (0.0,) * 4
    assert p.return_log_probs and o.streaming and o.exclude_input_in_output and o.pad_id == 0


def test_older_names_are_aliases():
    _, p, _ = parse_engine_request(request(**BASE, **{names.RANDOM_SEED: np.uint64(4), names.MIN_LENGTH: 2}))
    assert p.seed == 4 and p.min_tokens == 2
    with pytest.raises(RequestError, match="disagree"):
        parse_engine_request(request(**BASE, **{names.SEED: np.uint64(1), names.RANDOM_SEED: np.uint64(2)}))


@pytest.mark.parametrize("name, value, message", [
    (names.BEAM_WIDTH, 4, "beam_width 4"),
    (names.NUM_RETURN_SEQUENCES, 2, "num_return_sequences 2"),
    (names.LORA_TASK_ID, np.uint64(3), "LoRA"),
    (names.LORA_WEIGHTS, np.zeros((1, 2, 8), dtype=np.float16), "LoRA"),
    (names.PROMPT_EMBEDDING_TABLE, np.zeros((1, 2, 8), dtype=np.float16), "prompt tuning"),
    (names.GUIDED_DECODING_GUIDE, np.array([[b"{}"]], dtype=np.object_), "guided decoding"),
    (names.DRAFT_INPUT_IDS, [1, 2], "draft"),
    (names.TEMPERATURE, [0.5, 0.7], "one value per request"),
])
def test_inputs_kiln_cannot_honour(name, value, message):
    with pytest.raises(RequestError, match=message):
        parse_engine_request(request(**BASE, **{name: value}))


def test_preprocessing_default_end_id(tmp_path, tiny_engines):
    """The tokenizer's eos token, else the engine's first end id: never -1 (no end) by accident."""
    import json
    import shutil

    from tokenizers import Tokenizer

    from kiln.triton_repo.preprocessing import default_end_id

    engine = tiny_engines("llama")
    tokenizer_dir = engine / names.TOKENIZER_DIR
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / names.TOKENIZER_JSON))
    eos = json.loads((engine / names.ENGINE_JSON).read_text())["model"]["eos_ids"][0]
    assert default_end_id(tokenizer, str(tokenizer_dir)) == eos
    bare = tmp_path / "engine" / names.TOKENIZER_DIR  # no tokenizer_config.json: engine.json decides
    bare.mkdir(parents=True)
    shutil.copy(tokenizer_dir / names.TOKENIZER_JSON, bare)
    shutil.copy(engine / names.ENGINE_JSON, tmp_path / "engine")
    assert default_end_id(tokenizer, str(bare)) == eos
    (tmp_path / "engine" / names.ENGINE_JSON).unlink()
    assert default_end_id(tokenizer, str(bare)) == -1


@pytest.mark.parametrize("message, want", [
    ("UNAVAILABLE: busy: 1 requests are queued", ("UNAVAILABLE", "busy: 1 requests are queued")),
    ("INVALID_ARG: RequestError: beam_width 2", ("INVALID_ARG", "RequestError: beam_width 2")),
    ("busy: 1 requests are queued", ("INTERNAL", "busy: 1 requests are queued")),  # not coded
    ("Socket closed", ("INTERNAL", "Socket closed")),
])
def test_coded_error_messages_split_into_code_and_message(message, want):
    from kiln.triton_repo.model_utils import split_coded

    assert split_coded(message) == want
