"""Chat templates in families' published formats, written here (the tests have no network):
each renders tools, earlier calls and results, and the generation prompt as its family does."""

from __future__ import annotations

# Qwen3: tools in the system turn, Hermes calls; the generation prompt leaves thinking to the
# model, and `enable_thinking=False` closes an empty block for it
QWEN3 = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}<|im_start|>user
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content or '' }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

# DeepSeek-R1: the generation prompt opens the thinking block
DEEPSEEK_R1 = """\
{{ bos_token }}{%- for message in messages %}
{%- if message.role == 'user' %}<｜User｜>{{ message.content }}
{%- elif message.role == 'assistant' %}<｜Assistant｜>{{ message.content }}<｜end▁of▁sentence｜>
{%- endif %}
{%- endfor %}
{%- if tools %}{# calls: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME #}
{%- endif %}
{%- if add_generation_prompt %}<｜Assistant｜><think>
{% endif %}"""

# Llama 3.1: tools in the user turn as JSON, calls as a bare JSON object with "parameters"
LLAMA31 = """\
{{- bos_token }}<|start_header_id|>system<|end_header_id|>

{% if tools %}Environment: ipython
{% endif %}Cutting Knowledge Date: December 2023<|eot_id|>
{%- for message in messages %}
{%- if message.role == 'user' and tools and loop.last %}<|start_header_id|>user<|end_header_id|>

Given the following functions, please respond with a JSON for a function call with its proper \
arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name and its \
value}. Do not use variables.

{% for t in tools %}{{ t | tojson }}

{% endfor %}{{ message.content }}<|eot_id|>
{%- elif message.role == 'assistant' and message.tool_calls %}<|start_header_id|>assistant\
<|end_header_id|>

{%- for call in message.tool_calls %}<|python_tag|>{"name": "{{ call.function.name }}", \
"parameters": {{ call.function.arguments | tojson }}}{% endfor %}<|eom_id|>
{%- elif message.role in ('tool', 'ipython') %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

# Qwen3-Coder: calls with XML parameters
QWEN3_CODER = """\
{%- if tools %}<|im_start|>system
# Tools

You have access to the following functions:

<tools>
{%- for tool in tools %}
<function>
<name>{{ tool.function.name }}</name>
<parameters>{{ tool.function.parameters | tojson }}</parameters>
</function>
{%- endfor %}
</tools>

If you choose to call a function ONLY reply in the following format:

<tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# gpt-oss (harmony): channels; tools as a TypeScript namespace in the developer turn; calls go to
# the commentary channel addressed `to=functions.NAME`, thinking to the analysis channel
HARMONY = """\
<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.
Reasoning: medium

# Valid channels: analysis, commentary, final. Channel must be included for every message.
{%- if tools %}
Calls to these tools must go to the commentary channel: 'functions'.{% endif %}<|end|>
{%- if tools %}<|start|>developer<|message|># Tools

## functions

namespace functions {
{% for t in tools %}
type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;
{% endfor %}
} // namespace functions<|end|>
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}{% if m.thinking %}<|start|>assistant<|channel|>analysis\
<|message|>{{ m.thinking }}<|end|>{% endif %}<|start|>assistant<|channel|>final<|message|>\
{{ m.content }}<|end|>
{%- elif m.role == 'tool' %}<|start|>functions.{{ m.name }} to=assistant<|channel|>commentary\
<|message|>{{ m.content }}<|end|>
{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""
