// Reference GPT-2 ids for tests/test_bpe.cpp: reads a JSON array of strings (argv[3]) and
// prints {"gpt3": [[ids]...], "tiktoken": [[ids]...]} from npm gpt-3-encoder and js-tiktoken's
// "gpt2" encoding, both loaded from the node_modules folder argv[2].
const fs = require("fs");
const path = require("path");
const modules = process.argv[2];
const texts = JSON.parse(fs.readFileSync(process.argv[3], "utf8"));
const gpt3 = require(path.join(modules, "gpt-3-encoder"));
const { getEncoding } = require(path.join(modules, "js-tiktoken"));
const tiktoken = getEncoding("gpt2");
process.stdout.write(JSON.stringify({
  gpt3: texts.map((t) => gpt3.encode(t)),
  // Special-token text is plain text here, as in gpt-3-encoder.
  tiktoken: texts.map((t) => Array.from(tiktoken.encode(t, [], []))),
}));
