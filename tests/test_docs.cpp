// The README is a front page that stays short and true: at most 250 lines, every relative link
// in it and in docs/*.md names a file of the source tree (and, into a .md file, a heading that
// is there), and every command it shows starts a program the project has or builds.
// Standard library + GoogleTest only; the tree is found through POLYTRAIN_SOURCE_DIR (CMake).
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

const fs::path kRoot = POLYTRAIN_SOURCE_DIR;

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r") - b + 1);
}

bool starts_with(const std::string& s, const std::string& p) { return s.compare(0, p.size(), p) == 0; }

// ---- markdown ----------------------------------------------------------------------------

struct Markdown {
  std::string prose;                               // text outside fenced blocks (line breaks kept)
  std::vector<std::string> shell_lines;            // lines of ```bash / ```sh / ``` blocks
  std::vector<std::string> headings;               // "## Title" lines, without the #s
};

Markdown parse_markdown(const std::string& text) {
  Markdown md;
  bool in_fence = false, shell = false;
  std::string fence;
  for (const auto& raw : split_lines(text)) {
    const std::string t = trim(raw);
    if (!in_fence && (starts_with(t, "```") || starts_with(t, "~~~"))) {
      fence = t.substr(0, 3);
      const std::string info = trim(t.substr(3));
      in_fence = true;
      shell = info.empty() || info == "bash" || info == "sh";
      md.prose += '\n';
      continue;
    }
    if (in_fence) {
      if (starts_with(t, fence) && trim(t.substr(3)).empty()) {
        in_fence = false;
      } else if (shell) {
        md.shell_lines.push_back(raw);
      }
      md.prose += '\n';
      continue;
    }
    if (starts_with(t, "#")) {
      const auto h = t.find_first_not_of('#');
      if (h != std::string::npos && h <= 6 && t[h] == ' ') md.headings.push_back(trim(t.substr(h)));
    }
    md.prose += raw + '\n';
  }
  return md;
}

// Inline code spans blanked out (same length, so nothing after them moves): a link written
// inside backticks is an example, not a link.
std::string without_code_spans(const std::string& s) {
  std::string out = s;
  size_t i = 0;
  while (i < out.size()) {
    if (out[i] != '`') {
      ++i;
      continue;
    }
    size_t run = 0;
    while (i + run < out.size() && out[i + run] == '`') ++run;
    const std::string ticks(run, '`');
    const size_t close = out.find(ticks, i + run);
    if (close == std::string::npos) break;
    std::fill(out.begin() + static_cast<std::ptrdiff_t>(i), out.begin() + static_cast<std::ptrdiff_t>(close + run), ' ');
    i = close + run;
  }
  return out;
}

// Targets of [text](target) and ![alt](target) links and of [label]: target definitions.
std::vector<std::string> link_targets(const std::string& prose) {
  const std::string s = without_code_spans(prose);
  std::vector<std::string> targets;
  for (size_t i = s.find("]("); i != std::string::npos; i = s.find("](", i + 2)) {
    size_t depth = 0, j = i + 2;
    for (; j < s.size(); ++j) {
      if (s[j] == '(') ++depth;
      if (s[j] == ')') {
        if (depth == 0) break;
        --depth;
      }
      if (s[j] == '\n') break;
    }
    if (j >= s.size() || s[j] != ')') continue;
    std::string target = trim(s.substr(i + 2, j - i - 2));
    if (starts_with(target, "<") && target.find('>') != std::string::npos) target = target.substr(1, target.find('>') - 1);
    target = target.substr(0, target.find(' '));  // drop a "title"
    targets.push_back(target);
  }
  for (const auto& line : split_lines(s)) {  // [label]: target
    const std::string t = trim(line);
    const auto close = t.find("]:");
    if (starts_with(t, "[") && close != std::string::npos && t.find(']') == close) {
      const std::string target = trim(t.substr(close + 2));
      targets.push_back(target.substr(0, target.find(' ')));
    }
  }
  return targets;
}

bool is_external(const std::string& target) {
  return target.find("://") != std::string::npos || starts_with(target, "mailto:") || starts_with(target, "//");
}

// GitHub's heading anchor: lower case, punctuation other than '-' and '_' dropped, spaces to '-'.
std::string anchor_of(const std::string& heading) {
  std::string a;
  for (unsigned char c : heading) {
    if (std::isalnum(c) || c == '-' || c == '_') a += static_cast<char>(std::tolower(c));
    else if (c == ' ') a += '-';
    else if (c >= 0x80) a += static_cast<char>(c);  // non-ASCII letters stay
  }
  return a;
}

std::set<std::string> anchors_of(const fs::path& md_file) {
  std::set<std::string> anchors;
  std::map<std::string, int> seen;
  for (const auto& h : parse_markdown(read_text(md_file)).headings) {
    const std::string a = anchor_of(h);
    const int n = seen[a]++;
    anchors.insert(n == 0 ? a : a + "-" + std::to_string(n));
  }
  return anchors;
}

// Problems with the relative links of one markdown file (empty: none). A link names a path
// relative to the file's folder; "#anchor" alone names a heading of the file itself.
std::vector<std::string> check_links(const fs::path& md_file, const std::string& text, int* checked = nullptr) {
  std::vector<std::string> problems;
  const std::string where = fs::relative(md_file, kRoot).string();
  for (const auto& target : link_targets(parse_markdown(text).prose)) {
    if (target.empty() || is_external(target)) continue;
    const auto hash = target.find('#');
    const std::string path = target.substr(0, hash);
    const std::string anchor = hash == std::string::npos ? "" : target.substr(hash + 1);
    const fs::path file = path.empty() ? md_file : md_file.parent_path() / path.substr(0, path.find('?'));
    if (checked) ++*checked;
    if (!fs::exists(file)) {
      problems.push_back(where + ": link to " + target + ": no such file " + file.lexically_normal().string());
      continue;
    }
    if (!anchor.empty() && file.extension() == ".md" && !anchors_of(file).count(anchor))
      problems.push_back(where + ": link to " + target + ": " + fs::relative(file, kRoot).string() +
                         " has no heading with the anchor #" + anchor);
  }
  return problems;
}

// ---- commands ----------------------------------------------------------------------------

// One simple command of a shell line: its words, quotes removed.
using Words = std::vector<std::string>;

// Splits a shell line into simple commands at unquoted | || && ; & ( ), stops at an unquoted
// '#' that starts a word (a comment), and removes quotes. Enough for the lines a README shows.
std::vector<Words> simple_commands(const std::string& line) {
  std::vector<Words> cmds(1);
  std::string word;
  bool have_word = false;
  char quote = 0;
  auto end_word = [&] {
    if (have_word) cmds.back().push_back(word);
    word.clear();
    have_word = false;
  };
  auto end_cmd = [&] {
    end_word();
    if (!cmds.back().empty()) cmds.emplace_back();
  };
  for (size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quote) {
      if (c == quote) quote = 0;
      else word += c;
      continue;
    }
    if (c == '\'' || c == '"') {
      quote = c;
      have_word = true;
    } else if (c == '\\' && i + 1 < line.size()) {
      word += line[++i];
      have_word = true;
    } else if (c == '$' && i + 1 < line.size() && line[i + 1] == '(') {
      // $(...) is one word: keep it whole, nested parentheses included.
      int depth = 0;
      for (; i < line.size(); ++i) {
        word += line[i];
        if (line[i] == '(') ++depth;
        if (line[i] == ')' && --depth == 0) break;
      }
      have_word = true;
    } else if (c == ' ' || c == '\t') {
      end_word();
    } else if (c == '#' && !have_word) {
      break;
    } else if (c == '|' || c == '&' || c == ';' || c == '(' || c == ')') {
      end_cmd();
    } else {
      word += c;
      have_word = true;
    }
  }
  end_cmd();
  if (cmds.back().empty()) cmds.pop_back();
  return cmds;
}

bool is_assignment(const std::string& w) {
  const auto eq = w.find('=');
  if (eq == std::string::npos || eq == 0) return false;
  if (!(std::isalpha(static_cast<unsigned char>(w[0])) || w[0] == '_')) return false;
  return std::all_of(w.begin(), w.begin() + static_cast<std::ptrdiff_t>(eq),
                     [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; });
}

std::string strip_prefix(std::string w, const std::string& p) { return starts_with(w, p) ? w.substr(p.size()) : w; }

// What the project builds from one source file per program (CMakeLists.txt globs these folders
// the same way), and `launch`.
std::set<std::string> built_programs() {
  std::set<std::string> programs = {"launch"};
  for (const char* dir : {"examples", "tools", "bench"})
    for (const auto& e : fs::directory_iterator(kRoot / dir))
      if (e.path().extension() == ".cpp") programs.insert(e.path().stem().string());
  return programs;
}

const std::set<std::string> kStandardTools = {"bash", "sh",  "cmake", "cd",     "git",    "sudo",  "apt-get", "npm",
                                              "export", "ctest", "python3", "source", "mkdir", "cat", "echo"};

const std::vector<std::string> kTreeFolders = {"configs/", "scripts/", "docs/", "bench/", "examples/"};

// Problems with one command line (empty: none).
std::vector<std::string> check_command(const std::string& line, const std::set<std::string>& programs,
                                       int* checked = nullptr) {
  std::vector<std::string> problems;
  for (Words words : simple_commands(line)) {
    size_t first = 0;
    while (first < words.size() && is_assignment(words[first])) ++first;
    if (first == words.size()) continue;  // only assignments
    if (checked) ++*checked;
    const std::string name = strip_prefix(strip_prefix(words[first], "./"), "build/");
    if (!(kStandardTools.count(name) || programs.count(name) || (name.find('/') != std::string::npos && fs::exists(kRoot / name)) ||
          (name.find('/') == std::string::npos && fs::is_regular_file(kRoot / name))))
      problems.push_back("`" + trim(line) + "`: " + words[first] +
                         " is neither a file of the source tree, a program the project builds nor a standard tool");
    for (size_t i = first + 1; i < words.size(); ++i) {
      std::string arg = words[i];
      if (starts_with(arg, "-") && arg.find('=') != std::string::npos) arg = arg.substr(arg.find('=') + 1);
      arg = strip_prefix(arg, "./");
      if (arg.find_first_of("*?[$") != std::string::npos) continue;  // a pattern or a variable
      if (starts_with(arg, "build/")) {
        const std::string program = arg.substr(6, arg.find('/', 6) - 6);
        if (!programs.count(program))
          problems.push_back("`" + trim(line) + "`: " + words[i] + " is not a program the project builds");
        continue;
      }
      for (const auto& folder : kTreeFolders)
        if (starts_with(arg, folder) && !fs::exists(kRoot / arg))
          problems.push_back("`" + trim(line) + "`: " + words[i] + " does not exist in the source tree");
    }
  }
  return problems;
}

// The command lines of a README: the lines of its shell blocks (comments and blank lines
// skipped, backslash continuations joined) and, in table rows, code spans that start with
// build/, ./ or bash (the env_type table's "try it" column).
std::vector<std::string> command_lines(const std::string& text) {
  const Markdown md = parse_markdown(text);
  std::vector<std::string> lines;
  std::string pending;
  for (const auto& raw : md.shell_lines) {
    std::string t = trim(raw);
    if (pending.empty() && (t.empty() || starts_with(t, "#"))) continue;
    if (!t.empty() && t.back() == '\\') {
      pending += t.substr(0, t.size() - 1) + " ";
      continue;
    }
    lines.push_back(pending + t);
    pending.clear();
  }
  if (!pending.empty()) lines.push_back(pending);
  for (const auto& row : split_lines(md.prose)) {
    if (!starts_with(trim(row), "|")) continue;
    for (size_t open = row.find('`'); open != std::string::npos; open = row.find('`', open + 1)) {
      const size_t close = row.find('`', open + 1);
      if (close == std::string::npos) break;
      const std::string code = row.substr(open + 1, close - open - 1);
      if (starts_with(code, "build/") || starts_with(code, "./") || starts_with(code, "bash ")) lines.push_back(code);
      open = close;
    }
  }
  return lines;
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += "  " + x + "\n";
  return s;
}

}  // namespace

TEST(Docs, ReadmeIsAtMost250Lines) {
  const fs::path readme = kRoot / "README.md";
  ASSERT_TRUE(fs::exists(readme)) << readme;
  const std::string text = read_text(readme);
  size_t lines = static_cast<size_t>(std::count(text.begin(), text.end(), '\n'));
  if (!text.empty() && text.back() != '\n') ++lines;
  EXPECT_LE(lines, 250u) << "README.md has " << lines
                         << " lines: it is the front page (what polytrain is, the quick start, the env_type table, "
                            "using it from your own project, the layout); the rest belongs in docs/";
}

TEST(Docs, EveryLinkAndCommandInTheReadmeExists) {
  const auto programs = built_programs();
  ASSERT_TRUE(programs.count("train_bert") && programs.count("zero_to_fp32")) << "examples/ and tools/ not found under " << kRoot;

  // The checks catch what they are for: a broken link, a missing heading, an unknown program,
  // a missing config.
  const fs::path readme = kRoot / "README.md";
  EXPECT_EQ(check_links(readme, "see [x](docs/nonexistent.md) and `[y](docs/in_code.md)`\n").size(), 1u);
  EXPECT_EQ(check_links(readme, "[x](docs/config.md#no-such-heading-here)\n").size(), 1u);
  EXPECT_TRUE(check_links(readme, "[x](docs/config.md#command-line-flags) [y](https://example.org/z)\n").empty());
  EXPECT_EQ(check_command("frobnicate --config configs/bert_tiny.json", programs).size(), 1u);
  EXPECT_EQ(check_command("build/launch --num_gpus 2 build/train_bert --config configs/no_such.json", programs).size(), 1u);
  EXPECT_EQ(check_command("build/launch --num_gpus 2 build/train_nothing", programs).size(), 1u);
  EXPECT_TRUE(check_command("FOO=1 bash scripts/test.sh   # a comment naming configs/missing.json", programs).empty());

  // README: links and commands.
  const std::string text = read_text(readme);
  int links = 0, commands = 0;
  std::vector<std::string> problems = check_links(readme, text, &links);
  for (const auto& line : command_lines(text)) {
    auto p = check_command(line, programs, &commands);
    problems.insert(problems.end(), p.begin(), p.end());
  }
  // The quick start's two commands, which .ci/run and the scripts' headers refer to.
  const auto lines = command_lines(text);
  for (const char* cmd : {"bash scripts/quickstart.sh", "bash scripts/test.sh"})
    EXPECT_TRUE(std::any_of(lines.begin(), lines.end(), [&](const std::string& l) { return starts_with(l, cmd); }))
        << "README.md's quick start lost `" << cmd << "`";
  EXPECT_GE(links, 5) << "README.md: fewer links found than it has; is the parser reading it?";
  EXPECT_GE(commands, 5) << "README.md: fewer commands found than it shows; is the parser reading it?";

  // docs/*.md: relative links.
  int docs = 0;
  for (const auto& e : fs::directory_iterator(kRoot / "docs")) {
    if (e.path().extension() != ".md") continue;
    ++docs;
    auto p = check_links(e.path(), read_text(e.path()));
    problems.insert(problems.end(), p.begin(), p.end());
  }
  EXPECT_GT(docs, 0) << "no docs/*.md under " << kRoot;
  EXPECT_TRUE(problems.empty()) << problems.size() << " broken:\n" << joined(problems);
}
