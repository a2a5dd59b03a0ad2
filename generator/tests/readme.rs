//! Every command in README.md is checked here, so the README cannot drift from the code.
//!
//! The README's ```sh and ```console blocks are read command by command. The fast `deepep-nix`
//! commands are run (`releases`, `hash`, `env`, `lock --offline` as `lock --offline --check`, any
//! `--help`), and where a ```console block shows their output, the output must match (`<checkout>`
//! stands for the repository, a line `...` for "the rest"). Commands that need network, a GPU,
//! root or minutes are checked to exist instead: the `deepep-nix` subcommand and each of its
//! flags (from its `--help`), the repository script and each flag it is given (in the script's
//! text), the cargo package or binary, the flake attribute. A command no rule knows fails the
//! test, so a new kind of command needs a rule here. The last tests feed README fragments that
//! drift (a wrong hash, a flag that does not exist, a missing script) and expect the failure.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// A command of the README: its text, the README line it starts on, the output a console block
/// shows for it (None in ```sh blocks).
struct Cmd {
    line: usize,
    text: String,
    expected: Option<Vec<String>>,
}

fn commands(md: &str) -> Vec<Cmd> {
    let mut out = Vec::new();
    let mut lang: Option<String> = None;
    let mut pending = String::new();
    let mut pending_line = 0;
    for (i, raw) in md.lines().enumerate() {
        let n = i + 1;
        if let Some(rest) = raw.trim_start().strip_prefix("```") {
            lang = if lang.is_some() {
                None
            } else {
                Some(rest.trim().to_string())
            };
            continue;
        }
        match lang.as_deref() {
            Some("sh") => {
                let line = strip_comment(raw);
                if pending.is_empty() {
                    pending_line = n;
                }
                if let Some(head) = line.trim_end().strip_suffix('\\') {
                    pending.push_str(head);
                    pending.push(' ');
                    continue;
                }
                pending.push_str(&line);
                if !pending.trim().is_empty() {
                    out.push(Cmd {
                        line: pending_line,
                        text: pending.trim().to_string(),
                        expected: None,
                    });
                }
                pending.clear();
            }
            Some("console") => {
                if let Some(cmd) = raw.strip_prefix("$ ") {
                    out.push(Cmd {
                        line: n,
                        text: cmd.trim().to_string(),
                        expected: Some(Vec::new()),
                    });
                } else if let Some(last) = out.last_mut() {
                    if let Some(exp) = last.expected.as_mut() {
                        exp.push(raw.to_string());
                    }
                }
            }
            _ => {}
        }
    }
    out
}

/// The line without a shell comment (a `#` at the start or after white space, outside quotes).
fn strip_comment(line: &str) -> String {
    let (mut sq, mut dq, mut prev_space) = (false, false, true);
    for (i, c) in line.char_indices() {
        match c {
            '\'' if !dq => sq = !sq,
            '"' if !sq => dq = !dq,
            '#' if !sq && !dq && prev_space => return line[..i].to_string(),
            _ => {}
        }
        prev_space = c.is_whitespace();
    }
    line.to_string()
}

/// Shell words of one simple command list: quotes removed, `$(...)` kept inside its word;
/// `&&`, `||`, `|` and `;` outside quotes end a command.
fn split_commands(text: &str) -> Vec<Vec<String>> {
    let mut cmds = vec![Vec::new()];
    let mut word = String::new();
    let mut in_word = false;
    let (mut sq, mut dq, mut depth) = (false, false, 0usize);
    let chars: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if sq {
            if c == '\'' {
                sq = false
            } else {
                word.push(c)
            }
        } else if c == '$' && chars.get(i + 1) == Some(&'(') {
            depth += 1;
            word.push_str("$(");
            in_word = true;
            i += 1;
        } else if depth > 0 {
            if c == '(' {
                depth += 1
            }
            if c == ')' {
                depth -= 1
            }
            word.push(c);
        } else if dq {
            if c == '"' {
                dq = false
            } else {
                word.push(c)
            }
        } else if c == '\'' {
            sq = true;
            in_word = true;
        } else if c == '"' {
            dq = true;
            in_word = true;
        } else if c.is_whitespace() || c == ';' || c == '|' || c == '&' {
            if in_word {
                cmds.last_mut().unwrap().push(std::mem::take(&mut word));
                in_word = false;
            }
            if c != ' ' && c != '\t' && !cmds.last().unwrap().is_empty() {
                cmds.push(Vec::new());
            }
        } else {
            word.push(c);
            in_word = true;
        }
        i += 1;
    }
    if in_word {
        cmds.last_mut().unwrap().push(word);
    }
    cmds.retain(|c| !c.is_empty());
    cmds
}

struct Checker {
    repo: PathBuf,
    bin: PathBuf,
    scratch: tempfile::TempDir,
}

impl Checker {
    fn new() -> Self {
        Checker {
            repo: repo(),
            bin: PathBuf::from(env!("CARGO_BIN_EXE_deepep-nix")),
            scratch: tempfile::tempdir().unwrap(),
        }
    }

    /// Every problem of the README text, one line each (empty: the README is true).
    fn check(&self, md: &str) -> Vec<String> {
        let mut errs = Vec::new();
        for cmd in commands(md) {
            for words in split_commands(&cmd.text) {
                if let Err(e) = self.check_words(&words, cmd.expected.as_deref()) {
                    errs.push(format!("README line {}: `{}`: {e}", cmd.line, cmd.text));
                }
            }
        }
        errs
    }

    fn check_words(&self, words: &[String], expected: Option<&[String]>) -> Result<(), String> {
        // leading VAR=value assignments belong to the environment, not the command
        let words: Vec<&str> = words
            .iter()
            .map(String::as_str)
            .skip_while(|w| {
                w.split_once('=').is_some_and(|(k, _)| {
                    !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                })
            })
            .collect();
        let Some(&prog) = words.first() else {
            return Ok(());
        };
        match prog {
            "deepep-nix" => self.deepep_nix(&words[1..], expected),
            "cargo" => self.cargo(&words[1..]),
            "nix" => self.nix(&words[1..]),
            "eval" => {
                // eval "$(cmd ...)": check the inner command
                let inner = words
                    .get(1)
                    .and_then(|w| w.strip_prefix("$("))
                    .and_then(|w| w.strip_suffix(')'));
                match inner {
                    Some(inner) => split_commands(inner)
                        .iter()
                        .try_for_each(|c| self.check_words(c, None)),
                    None => Err("eval of something other than \"$(command)\"".into()),
                }
            }
            // third-party tools: they need network or a GPU machine; their use is DeepEP's own
            // documented build (docs/deepep.md) or a plain pip install of the built wheel
            "git" | "cd" | "pip" | "python3" | "sudo" => Ok(()),
            p if p.contains('/') => self.script(&words),
            p => Err(format!(
                "`{p}` is not covered by generator/tests/readme.rs: add a rule for it"
            )),
        }
    }

    fn run(&self, args: &[&str]) -> std::process::Output {
        Command::new(&self.bin)
            .args(args)
            .current_dir(&self.repo)
            .env_remove("DEEPEP_NIX_REPO")
            .output()
            .unwrap()
    }

    fn deepep_nix(&self, args: &[&str], expected: Option<&[String]>) -> Result<(), String> {
        let sub = *args.first().ok_or("no subcommand")?;
        let help = self.run(&[sub, "--help"]);
        if !help.status.success() {
            return Err(format!(
                "`deepep-nix {sub}` does not exist: {}",
                String::from_utf8_lossy(&help.stderr).trim()
            ));
        }
        let help = String::from_utf8_lossy(&help.stdout).into_owned();
        for flag in args.iter().filter(|a| a.starts_with("--")) {
            let flag = flag.split('=').next().unwrap();
            if !help
                .split(|c: char| c.is_whitespace() || c == ',' || c == '[' || c == ']')
                .any(|w| w == flag)
            {
                return Err(format!("`deepep-nix {sub} --help` has no flag {flag}"));
            }
        }
        let mut args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        let mut prefix = None;
        let run_it = match sub {
            "releases" | "hash" => true,
            "env" => {
                // a real NVSHMEM prefix is needed; the README's path is replaced by one made here
                let i = args
                    .iter()
                    .position(|a| a == "--prefix")
                    .ok_or("env without --prefix")?;
                let shown = args.get(i + 1).ok_or("--prefix without a path")?.clone();
                let fake = self.scratch.path().join("nvshmem");
                std::fs::create_dir_all(fake.join("lib")).unwrap();
                std::fs::write(fake.join("lib/libnvshmem_host.so.3"), b"").unwrap();
                args[i + 1] = fake.display().to_string();
                prefix = Some((fake.display().to_string(), shown));
                true
            }
            "lock"
                if args.iter().any(|a| a == "--offline")
                    && !args.iter().any(|a| a == "--source") =>
            {
                if !args.iter().any(|a| a == "--check") {
                    args.push("--check".into()); // the same work, but it only compares
                }
                true
            }
            _ => args.iter().any(|a| a == "--help"),
        };
        if !run_it {
            if expected.is_some_and(|e| !e.is_empty()) {
                return Err("a console block shows output of a command this test does not run; show it in a ```sh block or add a rule".into());
            }
            return Ok(());
        }
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = self.run(&refs);
        if !out.status.success() {
            return Err(format!(
                "exited with {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let mut got = String::from_utf8_lossy(&out.stdout).into_owned();
        if let Some((fake, shown)) = &prefix {
            got = got.replace(fake.as_str(), shown);
        }
        got = got.replace(&self.repo.display().to_string(), "<checkout>");
        match expected {
            Some(exp) => compare(exp, &got),
            None => Ok(()),
        }
    }

    fn cargo(&self, args: &[&str]) -> Result<(), String> {
        let packages = workspace_packages(&self.repo);
        let value = |flag: &str| {
            args.iter()
                .position(|a| *a == flag)
                .and_then(|i| args.get(i + 1))
                .copied()
        };
        match args.first().copied() {
            Some("install") => {
                let path = value("--path").ok_or("cargo install without --path")?;
                let toml = std::fs::read_to_string(self.repo.join(path).join("Cargo.toml"))
                    .map_err(|e| format!("{path}/Cargo.toml: {e}"))?;
                if !toml.contains("name = \"deepep-nix\"") {
                    return Err(format!("{path} does not build deepep-nix"));
                }
                Ok(())
            }
            Some("run") | Some("build") => {
                let p = value("-p").ok_or("cargo run/build without -p")?;
                if !packages.iter().any(|n| n == p) {
                    return Err(format!(
                        "no workspace package {p} (have: {})",
                        packages.join(", ")
                    ));
                }
                match args.iter().position(|a| *a == "--") {
                    Some(i) if p == "deepep-nix" => {
                        let mut words = vec!["deepep-nix".to_string()];
                        words.extend(args[i + 1..].iter().map(|s| s.to_string()));
                        self.check_words(&words, None)
                    }
                    _ => Ok(()),
                }
            }
            other => Err(format!(
                "cargo {other:?} is not covered by generator/tests/readme.rs"
            )),
        }
    }

    fn nix(&self, args: &[&str]) -> Result<(), String> {
        match args.first().copied() {
            Some("develop") | Some("build") | Some("run") | Some("flake") => {}
            other => {
                return Err(format!(
                    "nix {other:?} is not covered by generator/tests/readme.rs"
                ))
            }
        }
        let text = ["flake.nix", "pkgs/default.nix"]
            .iter()
            .map(|f| std::fs::read_to_string(self.repo.join(f)).unwrap_or_default())
            .collect::<String>();
        for attr in args.iter().filter_map(|a| a.strip_prefix(".#")) {
            let top = attr.split('.').next().unwrap();
            if let Some(release) = top.strip_prefix("nvshmem_") {
                // generated from the lock (pkgs/nvshmem/lib.nix): nvshmem_X_Y_Z[_cudaN]
                self.nvshmem_attr(release)?;
                continue;
            }
            let found = text.match_indices(top).any(|(i, _)| {
                let before = text[..i]
                    .chars()
                    .next_back()
                    .map_or(true, |c| !(c.is_alphanumeric() || c == '-' || c == '_'));
                let after = text[i + top.len()..]
                    .chars()
                    .next()
                    .map_or(true, |c| !(c.is_alphanumeric() || c == '-' || c == '_'));
                before && after
            });
            if !found {
                return Err(format!(
                    "the flake has no output named {top} (flake.nix, pkgs/default.nix)"
                ));
            }
        }
        Ok(())
    }

    /// `X_Y_Z[_cudaN]` names a release of the lock (with a build for CUDA N).
    fn nvshmem_attr(&self, release: &str) -> Result<(), String> {
        let (version, cuda) = match release.split_once("_cuda") {
            Some((v, m)) => (v.replace('_', "."), Some(m)),
            None => (release.replace('_', "."), None),
        };
        let lock: serde_json::Value = serde_json::from_slice(
            &std::fs::read(self.repo.join("pkgs/nvshmem/releases.json")).unwrap(),
        )
        .unwrap();
        let rel = lock["releases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["version"] == version.as_str())
            .ok_or(format!(
                "the lock has no NVSHMEM {version} (nvshmem_{release})"
            ))?;
        let has_major = |m: &str| {
            rel["systems"]
                .as_object()
                .unwrap()
                .values()
                .any(|builds| builds.get(m).is_some())
        };
        match cuda {
            Some(m) if !has_major(m) => Err(format!(
                "the lock has no CUDA {m} build of NVSHMEM {version}"
            )),
            _ => Ok(()),
        }
    }

    fn script(&self, words: &[&str]) -> Result<(), String> {
        let path = self.repo.join(words[0]);
        let text = std::fs::read_to_string(&path)
            .map_err(|_| format!("{} is not a file of the repository", words[0]))?;
        use std::os::unix::fs::PermissionsExt;
        if std::fs::metadata(&path).unwrap().permissions().mode() & 0o111 == 0 {
            return Err(format!("{} is not executable", words[0]));
        }
        for flag in words[1..].iter().filter(|a| a.starts_with("--")) {
            let flag = flag.split('=').next().unwrap();
            if !text.contains(flag) {
                return Err(format!("{} knows no option {flag}", words[0]));
            }
        }
        Ok(())
    }
}

fn workspace_packages(repo: &Path) -> Vec<String> {
    ["generator", "kernels", "kernels/harness", "python"]
        .iter()
        .filter_map(|d| std::fs::read_to_string(repo.join(d).join("Cargo.toml")).ok())
        .filter_map(|t| {
            t.lines().find_map(|l| {
                l.strip_prefix("name = \"")
                    .and_then(|r| r.strip_suffix('"'))
                    .map(String::from)
            })
        })
        .collect()
}

/// The output shown must be the output got, line by line; a shown line `...` (any indentation)
/// stands for the rest.
fn compare(shown: &[String], got: &str) -> Result<(), String> {
    let got: Vec<&str> = got.lines().collect();
    for (i, want) in shown.iter().enumerate() {
        if want.trim() == "..." {
            return Ok(());
        }
        match got.get(i) {
            Some(g) if g.trim_end() == want.trim_end() => {}
            Some(g) => {
                return Err(format!(
                    "output line {} differs:\n  README: {want}\n  actual: {g}",
                    i + 1
                ))
            }
            None => {
                return Err(format!(
                    "the README shows more output than the command prints (from: {want})"
                ))
            }
        }
    }
    if got.len() > shown.len() {
        return Err(format!("the command prints more than the README shows (next: {}); end the shown output with `...`", got[shown.len()]));
    }
    Ok(())
}

#[test]
fn the_readme_commands_work_as_shown() {
    let md = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let cmds = commands(&md);
    assert!(
        cmds.len() >= 10,
        "found only {} commands in README.md",
        cmds.len()
    );
    let errs = Checker::new().check(&md);
    assert!(
        errs.is_empty(),
        "README.md drifted from the code:\n{}",
        errs.join("\n")
    );
}

#[test]
fn the_hash_example_is_run_and_compared() {
    // the README's hash example runs, and a console block's output is what is compared
    let md = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let cmds = commands(&md);
    let hash = cmds
        .iter()
        .find(|c| c.text == "deepep-nix hash generator/Cargo.toml")
        .expect("README shows the hash example");
    let shown = hash.expected.as_ref().unwrap();
    let size = std::fs::metadata(repo().join("generator/Cargo.toml"))
        .unwrap()
        .len();
    assert!(
        shown[0].contains(&format!("{size} bytes")),
        "README shows {:?}, the file has {size} bytes",
        shown[0]
    );
}

/// The one problem the checker finds in a README fragment.
fn one_error(md: &str) -> String {
    let mut errs = Checker::new().check(md);
    assert_eq!(errs.len(), 1, "{errs:?}");
    errs.remove(0)
}

#[test]
fn a_wrong_hash_in_a_readme_fragment_is_caught() {
    let md = "```console\n$ deepep-nix hash generator/Cargo.toml\ngenerator/Cargo.toml (file, 1075 bytes: flat hash, for fetchurl)\n  hex   cd5e91dd65404caa04e311a20c345f1119d85ea2aa4b9f3ee089ca156e7710fa\n```\n";
    let err = one_error(md);
    assert!(
        err.starts_with(
            "README line 2: `deepep-nix hash generator/Cargo.toml`: output line 1 differs"
        ),
        "{err}"
    );
    assert!(
        err.contains("README: generator/Cargo.toml (file, 1075 bytes"),
        "{err}"
    );
}

#[test]
fn shown_output_must_be_complete_or_end_in_an_ellipsis() {
    let md = "```console\n$ deepep-nix releases --brief\nlock: <checkout>/pkgs/nvshmem/releases.json\n```\n";
    assert!(one_error(md).contains("prints more than the README shows"));
    let md = "```console\n$ deepep-nix releases --brief\nlock: <checkout>/pkgs/nvshmem/releases.json\n...\n```\n";
    assert!(Checker::new().check(md).is_empty());
}

#[test]
fn flags_subcommands_scripts_and_flake_outputs_that_do_not_exist_are_caught() {
    let cases = [
        (
            "deepep-nix releases --brieff",
            "`deepep-nix releases --help` has no flag --brieff",
        ),
        (
            "deepep-nix instal --version 3.4.5",
            "`deepep-nix instal` does not exist",
        ),
        (
            "deepep-nix install --version 3.4.5 --cuda 13 --prefx /opt/x",
            "has no flag --prefx",
        ),
        (
            "eval \"$(deepep-nix env --prefx /opt/x)\"",
            "has no flag --prefx",
        ),
        (
            "scripts/test-everything.sh",
            "scripts/test-everything.sh is not a file of the repository",
        ),
        (
            "python/scripts/gpu-run.sh --no-such-option target/wheels",
            "knows no option --no-such-option",
        ),
        (
            "cargo run --release -p deepep-nixx -- lock --offline",
            "no workspace package deepep-nixx",
        ),
        (
            "cargo run --release -p deepep-nix -- lock --ofline",
            "has no flag --ofline",
        ),
        (
            "nix build .#no-such-package",
            "the flake has no output named no-such-package",
        ),
        (
            "nix build .#nvshmem_3_4_6_cuda12",
            "the lock has no NVSHMEM 3.4.6",
        ),
        (
            "nix build .#nvshmem_3_3_9_cuda13",
            "the lock has no CUDA 13 build of NVSHMEM 3.3.9",
        ),
        (
            "frobnicate --all",
            "`frobnicate` is not covered by generator/tests/readme.rs",
        ),
    ];
    for (cmd, want) in cases {
        let err = one_error(&format!("```sh\n{cmd}   # a comment\n```\n"));
        assert!(err.contains(want), "{cmd}: {err}");
    }
    let checker = Checker::new();
    // and their correct forms pass
    for cmd in [
        "deepep-nix releases --brief",
        "scripts/test-all.sh",
        "nix build .#deep-ep",
        "nix build .#nvshmem_3_3_9_cuda12",
        "cargo run --release -p deepep-nix -- lock --offline",
    ] {
        assert_eq!(
            checker.check(&format!("```sh\n{cmd}\n```\n")),
            Vec::<String>::new(),
            "{cmd}"
        );
    }
}

#[test]
fn commands_are_read_as_the_shell_reads_them() {
    let cmds = commands(
        "```sh\nA=1 foo \\\n  --bar 'x # y' # comment\n```\n\n```console\n$ a\nout\n$ b\n```\n",
    );
    assert_eq!(cmds.len(), 3);
    assert_eq!(
        (cmds[0].line, cmds[0].text.as_str()),
        (2, "A=1 foo    --bar 'x # y'")
    );
    assert_eq!(cmds[1].expected.as_deref(), Some(&["out".to_string()][..]));
    assert_eq!(
        split_commands("a \"$(b 'c d')\" && e | f; g"),
        vec![
            vec!["a".to_string(), "$(b 'c d')".into()],
            vec!["e".into()],
            vec!["f".into()],
            vec!["g".into()]
        ]
    );
}
