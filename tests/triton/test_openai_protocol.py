"""The OpenAI frontend without a server: chat templates against transformers' own rendering,
request validation and refusals, stop sequences, limits."""
import json

import pytest

from kiln import constants as names
from kiln.triton_repo.chat_template import ChatTemplate, ChatTemplateError
from kiln.triton_repo.openai_engine import ServedModel
from kiln.triton_repo.openai_protocol import (ChatCompletionRequest, CompletionRequest, OpenAIError,
                                              validation_error)
from kiln.triton_repo.openai_server import Frontend, StopText
from tests.helpers import SMOLLM2_FILE, make_tokenizer, smollm2_dir

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And \"quoted\" <b>html</b> é?"}],
    [{"role": "user", "content": "  spaces  \n\nand lines  "}],
]

# templates in the styles models ship (ChatML, Llama 3, Mistral's alternation check, Gemma's
# role mapping), using what transformers gives templates: bos_token, raise_exception, tojson,
# loop controls, namespace, trim_blocks / lstrip_blocks
TEMPLATES = {
    "llama3": (
        "{{ bos_token }}{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"),
    "mistral": (
        "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
        "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}\n"
        "{{- bos_token }}\n{%- for message in loop_messages %}\n"
        "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
        "        {{- raise_exception('roles must alternate user/assistant') }}\n    {%- endif %}\n"
        "    {%- if message['role'] == 'user' %}\n"
        "        {{- '[INST] ' + (system + '\n\n' if system is defined and loop.first else '') + message['content'] + '[/INST]' }}\n"
        "    {%- else %}\n        {{- message['content'] + eos_token }}\n    {%- endif %}\n{%- endfor %}\n"),
    "gemma_tojson": (
        "{% set ns = namespace(count=0) %}{% for message in messages %}"
        "{% if message['role'] == 'system' %}{% continue %}{% endif %}{% set ns.count = ns.count + 1 %}"
        "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
        "{{ message['content'] | tojson }}<end_of_turn>\n{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}{{ ns.count }}"),
}


@pytest.fixture(scope="module")
def smollm2_tokenizer_dir(tmp_path_factory):
    """The engine tokenizer folder kiln writes for the SmolLM2 GGUF (template from the GGUF)."""
    import gguf

    from kiln.builder.checkpoint.gguf import _tokenizer_json

    path = smollm2_dir() / SMOLLM2_FILE
    tokenizer_json, config = _tokenizer_json(gguf.GGUFReader(path), path)
    folder = tmp_path_factory.mktemp("smollm2_tokenizer")
    (folder / names.TOKENIZER_JSON).write_text(tokenizer_json)
    (folder / names.TOKENIZER_CONFIG_JSON).write_text(config)
    return folder


def test_the_gguf_chat_template_renders_as_transformers_does(smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    template = ChatTemplate.from_tokenizer_dir(smollm2_tokenizer_dir)
    assert template is not None and "<|im_start|>" in template.source
    for messages in CONVERSATIONS:
        for generation in (True, False):
            expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
            assert template.render(messages, add_generation_prompt=generation) == expected, messages


@pytest.mark.parametrize("style", sorted(TEMPLATES))
def test_templates_saved_by_transformers_render_as_transformers_does(style, tmp_path):
    """transformers saves the template as chat_template.jinja; the engine keeps that file."""
    from transformers import AutoTokenizer

    make_tokenizer(tmp_path / "made", 300)
    made = AutoTokenizer.from_pretrained(tmp_path / "made")
    made.chat_template = TEMPLATES[style]
    made.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / names.CHAT_TEMPLATE_FILE).is_file() or "chat_template" in json.loads(
        (tmp_path / "saved" / names.TOKENIZER_CONFIG_JSON).read_text())
    reference = AutoTokenizer.from_pretrained(tmp_path / "saved")
    template = ChatTemplate.from_tokenizer_dir(tmp_path / "saved")
    for messages in CONVERSATIONS:
        expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert template.render(messages) == expected, (style, messages)


def test_a_list_of_named_templates_uses_the_default_one(tmp_path):
    (tmp_path / names.TOKENIZER_CONFIG_JSON).write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "{{ messages[0]['content'] }}"}]}))
    assert ChatTemplate.from_tokenizer_dir(tmp_path).render([{"role": "user", "content": "hi"}]) == "hi"


def test_template_errors_are_clear_and_the_sandbox_holds(tmp_path):
    assert ChatTemplate.from_tokenizer_dir(tmp_path) is None  # no template at all
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
    alternating = ChatTemplate(TEMPLATES["mistral"], {"bos_token": "<s>", "eos_token": "</s>"})
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        alternating.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    escape = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError, match="refused"):
        escape.render([{"role": "user", "content": "a"}])


def test_stop_sequences_hold_back_what_could_still_match():
    stop = StopText(["###", "END"])
    assert stop.feed("Hello #") == ("Hello ", False)  # "#" could start "###"
    assert stop.feed("#") == ("", False)
    assert stop.feed(" no") == ("## no", False)  # "## n" cannot start a stop any more
    assert stop.feed(" more EN") == (" more ", False)
    assert stop.feed("D and after") == ("", True)  # the text before the stop, nothing after
    assert stop.flush() == ""
    first = StopText(["b", "abc"])
    assert first.feed("xxabc") == ("xx", True)  # the stop that begins first wins
    plain = StopText([])
    assert plain.feed("all of it") == ("all of it", False) and plain.flush() == ""


def _refused(model, match: str, **fields):
    body = model.model_validate({"model": "m", **fields})
    with pytest.raises(OpenAIError, match=match) as caught:
        body.refuse_unsupported()
    assert caught.value.status == 400
    return caught.value


def test_requests_kiln_cannot_honour_are_refused_by_name():
    prompt = {"prompt": "hi"}
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert _refused(CompletionRequest, "n=2", n=2, **prompt).param == "n"
    assert _refused(CompletionRequest, "best_of", best_of=3, **prompt).param == "best_of"
    _refused(CompletionRequest, "echo", echo=True, **prompt)
    _refused(CompletionRequest, "suffix", suffix="x", **prompt)
    _refused(CompletionRequest, "logprobs=3", logprobs=3, **prompt)
    _refused(CompletionRequest, "2 prompts", prompt=["a", "b"])
    _refused(CompletionRequest, "stream_options", stream_options={"include_usage": True}, **prompt)
    _refused(ChatCompletionRequest, "tools", tools=[{"type": "function"}], **chat)
    _refused(ChatCompletionRequest, "json_object", response_format={"type": "json_object"}, **chat)
    _refused(ChatCompletionRequest, "top_logprobs=2", logprobs=True, top_logprobs=2, **chat)
    _refused(ChatCompletionRequest, "needs logprobs", top_logprobs=1, **chat)
    _refused(ChatCompletionRequest, "disagree", max_tokens=5, max_completion_tokens=6, **chat)
    # what does not change the answer is accepted
    CompletionRequest.model_validate({"model": "m", "user": "u", "metadata": {"a": 1}, **prompt}).refuse_unsupported()


@pytest.mark.parametrize("fields, where", [
    ({"prompt": "hi", "temperature": 3}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "hi", "presence_penalty": -3}, "presence_penalty"),
    ({}, "prompt"),
])
def test_bad_values_name_the_field(fields, where):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as caught:
        CompletionRequest.model_validate({"model": "m", **fields})
    error = validation_error(caught.value)
    assert error.status == 400 and error.param == where and where in error.message


def test_chat_messages_are_checked():
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "m", "messages": []})
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "wizard", "content": "x"}]})
    parts = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert parts.messages[0].as_template_input() == {"role": "user", "content": "ab"}
    image = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    with pytest.raises(OpenAIError, match="image_url"):
        image.messages[0].as_template_input()


@pytest.fixture
def served(tmp_path):
    from tokenizers import Tokenizer

    make_tokenizer(tmp_path, 300)
    return ServedModel(name="tiny", engine_model="kiln", engine_dir=tmp_path, tokenizer=Tokenizer.from_file(
        str(tmp_path / names.TOKENIZER_JSON)), token_bytes=None, chat_template=None, vocab_size=300,
        max_input_len=64, max_seq_len=100, created=0)


def test_limits_and_a_missing_template_get_a_400(served):
    assert served.output_limit(30, None) == 70  # all the engine allows
    assert served.output_limit(30, 70) == 70
    with pytest.raises(OpenAIError, match="maximum context length of 100") as caught:
        served.output_limit(30, 71)
    assert caught.value.code == "context_length_exceeded"
    with pytest.raises(OpenAIError, match="maximum input of 64"):
        served.output_limit(65, 1)
    frontend = Frontend(served, "127.0.0.1:1")
    chat = ChatCompletionRequest.model_validate({"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(OpenAIError, match="no chat template") as caught:
        frontend.chat_prompt(chat)
    assert caught.value.status == 400
    with pytest.raises(OpenAIError, match="does not exist") as caught:
        frontend._check_model("gpt-4")
    assert caught.value.status == 404 and caught.value.code == "model_not_found"
    completion = CompletionRequest.model_validate({"model": "tiny", "prompt": [5, 300]})
    with pytest.raises(OpenAIError, match="outside the vocabulary"):
        frontend._engine_request(completion, frontend.completion_prompt(completion), False)
    biased = CompletionRequest.model_validate({"model": "tiny", "prompt": "x", "logit_bias": {"7": 5, "299": -100}})
    request = frontend._engine_request(biased, [1, 2], False)
    assert request.embedding_bias[7] == 5 and request.embedding_bias[299] == -100 and request.max_tokens == 16
    tensors = request.tensors()
    assert tensors[names.EMBEDDING_BIAS].shape == (1, 300) and names.END_ID not in tensors
