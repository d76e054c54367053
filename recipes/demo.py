"""A local web page to look at a trained model: type a problem (or pick a held-out one), and the
trained model and its base answer side by side, streamed token by token from rollout.generate,
each with the answer it commits to and whether the verifier accepts it.

    python recipes/demo.py --model runs/NAME/final                  # against the bundled SmolLM2-135M
    python recipes/demo.py --model runs/NAME/final --base Qwen/Qwen2.5-0.5B-Instruct --port 8000

The standard library's HTTP server: GET / is the page, GET /problems a few held-out problems of
--data, GET /answer streams one model's answer as server-sent events ("text" events with the
text so far, then "done" with the answer and the verdict, or "refused" naming a bad input). It
binds to 127.0.0.1 unless --host says otherwise; it never runs what it is sent, only samples text.
"""

import argparse
import json
import math
import os
import random
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo's root

import data
import rollout
from engine.paged import EngineOptions
from engine.speed import keep_freed_memory, pack_linears
from engine.speedups import SpeedUps
from run import checkpoints
from tasks import verify

MAX_QUESTION_CHARS = 2000   # what the page takes in one problem
MAX_ANSWER_CHARS = 200      # a reference answer
MAX_NEW_TOKENS = 1024       # the largest budget the page may ask for
MAX_TEMPERATURE = 2.0


# ---- the models --------------------------------------------------------------------------------

class Answerer:
    """One model behind the page: its tokenizer, prompt template and stop tokens; one request at a
    time (a lock), so that two open pages take turns rather than share a model's threads."""

    def __init__(self, name, model, tokenizer, template):
        self.name, self.model, self.tokenizer, self.template = name, model, tokenizer, template
        self.stop_ids = rollout.stop_token_ids(tokenizer)
        self.lock = threading.Lock()

    def answer(self, question, temperature, max_new_tokens, on_text):
        """Samples one response, calling on_text(text so far) as it grows -> the whole text.
        Refused when the prompt and the budget do not fit the model's context."""
        def stream(tokens):  # (1, steps); a stopped row's tail is zeros, cut at the stop
            on_text(self.tokenizer.decode(self.until_stop(tokens[0].tolist()), skip_special_tokens=True))
        with self.lock:  # the tokenizer too: a fast tokenizer is not to be shared between threads
            prompt_ids = data.format_prompt({"prompt": question}, self.tokenizer, self.template)
            context = self.model.config.max_seq_len
            if len(prompt_ids) + max_new_tokens > context:
                raise Refused(f"the problem ({len(prompt_ids)} tokens) and the budget "
                              f"({max_new_tokens}) do not fit the model's context of {context}")
            sampling = rollout.Sampling(max_new_tokens=max_new_tokens, temperature=temperature,
                                        stop_token_ids=self.stop_ids, seed=random.getrandbits(62))
            [completion] = rollout.generate(self.model, [prompt_ids], sampling, stream=stream,
                                            engine=EngineOptions(speed=SpeedUps(compile=False)))
            return self.tokenizer.decode(completion.tokens, skip_special_tokens=True)

    def until_stop(self, tokens):
        ends = [i for i, token in enumerate(tokens) if token in self.stop_ids]
        return tokens[:ends[0] + 1] if ends else tokens


def run_template(model_path, fallback):
    """The prompt template the model was trained with: a run's config.json beside its final/, else
    `fallback`."""
    saved = os.path.join(os.path.dirname(os.path.abspath(model_path)), "config.json") \
        if model_path and os.path.isdir(model_path) else None
    if saved and os.path.isfile(saved):
        with open(saved) as f:
            template = json.load(f).get("template")
        if template in data.TEMPLATES:
            return template
    return fallback


# ---- checking a request ------------------------------------------------------------------------

class Refused(ValueError):
    """A request the page must not run, with the reason shown on it."""


def read_request(query, answerers):
    """The query of GET /answer -> (answerer, question, reference answer or None, temperature,
    max_new_tokens); Refused names the first bad field."""
    def field(name, default=""):
        return query.get(name, [default])[0]
    if field("model") not in answerers:
        raise Refused(f"model must be one of {', '.join(answerers)}")
    question, reference = field("question").strip(), field("reference").strip()
    if not question:
        raise Refused("type a problem first")
    if len(question) > MAX_QUESTION_CHARS:
        raise Refused(f"the problem is {len(question)} characters; at most {MAX_QUESTION_CHARS}")
    if len(reference) > MAX_ANSWER_CHARS:
        raise Refused(f"the reference answer is {len(reference)} characters; at most {MAX_ANSWER_CHARS}")
    try:
        temperature = float(field("temperature", "0"))
        max_new_tokens = int(field("max_new_tokens", "256"))
    except ValueError:
        raise Refused("temperature must be a number and the token budget a whole number") from None
    if not (math.isfinite(temperature) and 0 <= temperature <= MAX_TEMPERATURE):
        raise Refused(f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {field('temperature')}")
    if not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise Refused(f"the token budget must be between 1 and {MAX_NEW_TOKENS}, got {max_new_tokens}")
    return answerers[field("model")], question, reference or None, temperature, max_new_tokens


# ---- the server --------------------------------------------------------------------------------

class Handler(BaseHTTPRequestHandler):
    """The page, the problems, and one streamed answer per request. The server object carries
    `answerers` (name -> Answerer), `problems` (a list of {"prompt", "answer"}) and `hosts` (the
    Host headers it answers). Another site's page that points a browser here is refused
    (`from_elsewhere`); a request it cannot parse gets the standard 4xx/5xx reply."""
    timeout = 60  # seconds: a page that stops reading frees its model
    default_request_version = "HTTP/1.0"  # an unparsed request's error reply has a status line

    def handle(self):
        """Every request; a client gone before its reply is sent ends it quietly."""
        try:
            super().handle()
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass

    def from_elsewhere(self):
        """A request that another site's page made a browser send: a Host other than ours, or
        (for sampling, which costs the machine) a browser's word that it is cross-site
        (Sec-Fetch-Site) or an Origin that is not ours."""
        if self.headers.get("Host", "").rsplit(":", 1)[0] not in self.server.hosts:
            return True
        if not urlparse(self.path).path.startswith("/answer"):
            return False  # the page itself may be opened from a link anywhere
        origin = urlparse(self.headers.get("Origin", ""))
        return self.headers.get("Sec-Fetch-Site", "same-origin") not in ("same-origin", "none") \
            or (self.headers.get("Origin") is not None
                and origin.hostname not in {host.strip("[]") for host in self.server.hosts})

    def do_GET(self):
        url = urlparse(self.path)
        if self.from_elsewhere():
            self.send_error(403, "this demo answers pages it serves itself")
        elif url.path == "/":
            page = PAGE.replace("MAX_QUESTION_CHARS", str(MAX_QUESTION_CHARS)).replace(
                "MAX_ANSWER_CHARS", str(MAX_ANSWER_CHARS))
            self.send_body(page.encode(), "text/html; charset=utf-8")
        elif url.path == "/problems":
            self.send_body(json.dumps({
                "problems": self.server.problems,
                "models": {name: a.name for name, a in self.server.answerers.items()}}).encode(),
                "application/json")
        elif url.path == "/answer":
            self.stream_answer(parse_qs(urlparse(self.path).query))
        else:
            self.send_error(404)

    def send_body(self, body, content_type):
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def stream_answer(self, query):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        try:
            answerer, question, reference, temperature, max_new_tokens = \
                read_request(query, self.server.answerers)
            text = answerer.answer(question, temperature, max_new_tokens,
                                   lambda so_far: self.send_event("text", {"text": so_far}))
            self.send_event("done", {"text": text, "answer": verify.extract_answer(text),
                                     "verdict": None if reference is None else
                                     ("correct" if verify.is_correct(text, reference) else "wrong")})
        except Refused as reason:
            self.send_event("refused", {"error": str(reason)})
        except (BrokenPipeError, ConnectionResetError, TimeoutError):  # the page went: stop sampling
            pass
        except Exception as error:  # said on the page and here, and the server goes on
            print(f"demo.py: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
            self.send_event("refused", {"error": f"the model failed: {type(error).__name__}: {error}"})

    def send_event(self, kind, payload):
        self.wfile.write(f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode())
        self.wfile.flush()

    def log_message(self, format, *args):  # one line a request on stderr, not the default's two
        path = getattr(self, "path", None)  # None: a request line that could not be read
        if path is None or not path.startswith("/answer"):
            return
        sys.stderr.write(f"demo.py: {self.address_string()} {urlparse(path).path}\n")


# ---- the page ----------------------------------------------------------------------------------

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>DAPO: a trained model beside its base</title>
<style>
 body { font-family: system-ui, sans-serif; max-width: 68em; margin: 1.5em auto; padding: 0 1em; }
 textarea { width: 100%; height: 5em; font: inherit; }
 .row { display: flex; gap: 1em; align-items: center; flex-wrap: wrap; margin: .5em 0; }
 .answers { display: flex; gap: 1em; }
 .answer { flex: 1; border: 1px solid #ccc; border-radius: 6px; padding: .5em 1em; min-height: 10em; }
 .answer pre { white-space: pre-wrap; font: .95em ui-monospace, monospace; }
 .correct { color: #117a2b; font-weight: bold; } .wrong { color: #b3261e; font-weight: bold; }
 #refused { color: #b3261e; }
</style></head>
<body>
<h2>A trained model beside its base</h2>
<form id="ask">
 <div class="row"><label>A held-out problem <select id="problems"><option value="">(type your own)</option></select></label></div>
 <textarea id="question" maxlength="MAX_QUESTION_CHARS" placeholder="What is 17 + 25?"></textarea>
 <div class="row">
  <label>Reference answer <input id="reference" size="12" maxlength="MAX_ANSWER_CHARS"></label>
  <label>Temperature <input id="temperature" value="0" size="4"></label>
  <label>Token budget <input id="max_new_tokens" value="256" size="5"></label>
  <button id="go" type="submit">Ask both</button>
 </div>
 <div id="refused"></div>
</form>
<div class="answers">
 <div class="answer" id="trained"><h3></h3><pre class="text"></pre><p>Answer: <span class="extracted"></span> <span class="verdict"></span></p></div>
 <div class="answer" id="base"><h3></h3><pre class="text"></pre><p>Answer: <span class="extracted"></span> <span class="verdict"></span></p></div>
</div>
<script>
const $ = (id) => document.getElementById(id);
let problems = [];
fetch("/problems").then((r) => r.json()).then((info) => {
  problems = info.problems;
  problems.forEach((p, i) => $("problems").add(new Option(p.prompt.slice(0, 80), i)));
  for (const which of ["trained", "base"]) $(which).querySelector("h3").textContent = which + ": " + info.models[which];
});
$("problems").onchange = () => {
  const p = problems[$("problems").value];
  if (p) { $("question").value = p.prompt; $("reference").value = p.answer; }
};
function ask(which) {
  const box = $(which), query = new URLSearchParams({model: which});
  for (const name of ["question", "reference", "temperature", "max_new_tokens"]) query.set(name, $(name).value);
  box.querySelector(".text").textContent = "";
  box.querySelector(".extracted").textContent = "";
  const verdict = box.querySelector(".verdict");
  verdict.textContent = ""; verdict.className = "verdict";
  if (box.events) box.events.close();  // a new question: the last one's stream ends
  const events = box.events = new EventSource("/answer?" + query);
  events.addEventListener("text", (e) => { box.querySelector(".text").textContent = JSON.parse(e.data).text; });
  events.addEventListener("done", (e) => {
    const done = JSON.parse(e.data);
    box.querySelector(".text").textContent = done.text;
    box.querySelector(".extracted").textContent = done.answer === null ? "(none)" : done.answer;
    verdict.textContent = done.verdict === null ? "(no reference to check)" : done.verdict;
    if (done.verdict) verdict.classList.add(done.verdict);
    box.dataset.state = "done";
    events.close();
  });
  events.addEventListener("refused", (e) => { $("refused").textContent = JSON.parse(e.data).error; events.close(); });
  events.onerror = () => events.close();
}
$("ask").onsubmit = (e) => {
  e.preventDefault();
  $("refused").textContent = "";
  for (const which of ["trained", "base"]) { $(which).dataset.state = "asked"; ask(which); }
};
</script>
</body></html>
"""


# ---- the command line ----------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="demo.py", description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("--model", required=True, help="the trained model: a run's final/ directory "
                        "(or any directory save_model writes, a .gguf file, a hub id)")
    parser.add_argument("--base", default=None, help="what it is compared with (default: the bundled "
                        "SmolLM2-135M-Instruct)")
    parser.add_argument("--data", default="arithmetic", help="where the page's problems come from: "
                        "held-out problems of any one-turn --data of train.py (default: arithmetic)")
    parser.add_argument("--template", choices=data.TEMPLATES, default=None, help="prompt template "
                        "of both models (default: the trained run's, from its config.json beside "
                        "final/; else none)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, "
                        "this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0: any free one)")
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"argument --port: must be 0..65535, got {args.port}")
    return parser, args


def load_answerer(parser, flag, path, dtype, template):
    try:
        model, tokenizer = checkpoints.load_model(path, dtype=dtype, device="cpu")
    except (OSError, ValueError) as error:
        parser.error(f"argument {flag}: {error}")
    return Answerer(path or "bundled SmolLM2-135M-Instruct", pack_linears(model.eval()), tokenizer,
                    template)


def main(argv=None):
    parser, args = parse_args(argv)
    try:
        problems = [{"prompt": r["prompt"], "answer": r["answer"]}
                    for r in data.load_records(args.data, split="test", limit=20)]
    except data.DataError as error:
        parser.error(f"argument --data: {error}")
    keep_freed_memory()  # as train.py: a decode step's freed blocks are not faulted in again
    dtype = torch.bfloat16 if checkpoints.cpu_has_bf16() else torch.float32
    template = args.template or run_template(args.model, "none")  # both asked the same way
    answerers = {"trained": load_answerer(parser, "--model", args.model, dtype, template),
                 "base": load_answerer(parser, "--base", args.base, dtype, template)}
    try:
        server = ThreadingHTTPServer((args.host, args.port), Handler)
    except OSError as error:
        parser.error(f"argument --host/--port: cannot listen on {args.host}:{args.port}: "
                     f"{error.strerror or error}")
    server.answerers, server.problems = answerers, problems
    server.hosts = {"127.0.0.1", "localhost", "[::1]"} | ({args.host} if args.host not in ("", "0.0.0.0") else set())
    server.daemon_threads = True
    print(f"serving http://{args.host}:{server.server_address[1]}/ (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped", flush=True)
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
