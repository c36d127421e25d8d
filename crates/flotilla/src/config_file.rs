//! `--config FILE.toml`: command-line options read from a TOML file.
//!
//! Before clap parses, [`expand`] replaces each `--config PATH` (or `--config=PATH`) after a
//! subcommand with the options the file holds, placed *before* the user's own arguments. A
//! flag the user also gives on the command line is dropped from the file's options, so
//! explicit flags always win (and `args_override_self` lets a repeated flag override itself).
//!
//! The file's keys are the subcommand's long flag names, `-` or `_` alike; tables (`[model]`,
//! `[train]`, ...) only group keys and are flattened. Values map to arguments as follows:
//!
//! | TOML value                 | argument                                                 |
//! |----------------------------|----------------------------------------------------------|
//! | `layers = 4`, `lr = 3e-4`  | `--layers=4`, `--lr=0.0003`                              |
//! | `data = "grammar"`         | `--data=grammar`                                         |
//! | `bf16 = true` / `false`    | `--bf16` / nothing                                       |
//! | `dataset = ["a", "b"]`     | `--dataset=a --dataset=b` (a repeatable flag)            |
//! | `weights = [0.7, 0.3]`     | `--weights=0.7,0.3` (a flag taking a comma list)         |
//!
//! Commands whose `--config` already names something else (`train` and `bench model`: the
//! model preset) read a file only when the value ends in `.toml`; there the key `config`
//! still selects the preset (`config = "small"`). Files never name other files.
//!
//! Every key is checked against the subcommand's clap arguments and every value against
//! the flag's parser, so a mistake names the file, the key and (for an unknown key) the
//! closest valid flag. Relative paths in values are relative to the working directory, as
//! on the command line.
use anyhow::{Context, Result, bail};
use clap::{Arg, ArgAction, Command};
use std::collections::HashSet;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// Expands every `--config FILE.toml` after the subcommand of `argv` (a full argument
/// vector, program name first) into the file's options. `cmd` is the program's clap command
/// (`Cli::command()`). Returns `argv` unchanged when it names no config file.
pub fn expand(cmd: &Command, argv: impl IntoIterator<Item = OsString>) -> Result<Vec<OsString>> {
    let argv: Vec<OsString> = argv.into_iter().collect();
    if !argv
        .iter()
        .any(|a| a.to_string_lossy().starts_with("--config"))
    {
        return Ok(argv);
    }
    // The subcommand path: the program name, then nested subcommand names.
    let (mut sub, mut n) = (cmd, 1);
    let mut name = cmd.get_name().to_string();
    while let Some(next) = argv
        .get(n)
        .and_then(|a| a.to_str())
        .and_then(|a| sub.find_subcommand(a))
    {
        name = format!("{name} {}", next.get_name());
        sub = next;
        n += 1;
    }
    if n == 1 {
        return Ok(argv);
    }
    let has_preset = find_arg(sub, "config").is_some();
    let is_file = |v: &str| !has_preset || v.to_ascii_lowercase().ends_with(".toml");
    let (mut files, mut rest) = (Vec::<PathBuf>::new(), Vec::<OsString>::new());
    let mut i = n;
    while i < argv.len() {
        let a = argv[i].to_string_lossy();
        if a == "--" {
            rest.extend_from_slice(&argv[i..]);
            break;
        }
        if a == "--config" {
            match argv.get(i + 1) {
                Some(v) if is_file(&v.to_string_lossy()) => {
                    files.push(PathBuf::from(v));
                    i += 2;
                    continue;
                }
                None if !has_preset => bail!("--config needs a TOML file: --config FILE.toml"),
                _ => {}
            }
        } else if let Some(v) = a.strip_prefix("--config=").filter(|v| is_file(v)) {
            files.push(PathBuf::from(v));
            i += 1;
            continue;
        }
        rest.push(argv[i].clone());
        i += 1;
    }
    if files.is_empty() {
        return Ok(argv);
    }
    let given = user_flags(sub, &rest);
    // One entry per flag, in file order; a later file replaces an earlier one's value.
    let mut options: Vec<(String, Vec<String>)> = Vec::new();
    for path in &files {
        let mut seen: HashSet<String> = HashSet::new();
        for (key, value) in read_table(path)? {
            let at = || format!("{}: key `{key}`", path.display());
            let arg = resolve_key(sub, &name, path, &key, &value)?;
            let id = arg.get_id().to_string();
            if !seen.insert(id.clone()) {
                bail!("{}: flag --{} given twice", at(), long(arg));
            }
            let tokens = to_tokens(arg, &value).with_context(at)?;
            options.retain(|(other, _)| *other != id);
            if !given.contains(&id) {
                options.push((id, tokens));
            }
        }
    }
    let mut out = argv[..n].to_vec();
    out.extend(options.into_iter().flat_map(|(_, t)| t).map(OsString::from));
    out.extend(rest);
    Ok(out)
}

/// Reads and parses `path`, returning its keys flattened out of any tables, in file order.
fn read_table(path: &Path) -> Result<Vec<(String, toml::Value)>> {
    // A regular file of at most 1 MiB: a FIFO or a link to a device is refused, not read.
    let text = fsread::read_text_bounded(path, 1 << 20, fsread::Links::Follow)
        .with_context(|| format!("reading config file {}", path.display()))?;
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| anyhow::anyhow!("config file {}: {e}", path.display()))?;
    let mut out = Vec::new();
    flatten("", table, &mut out);
    Ok(out)
}

/// Appends the keys of `table` to `out` as `prefix` + key, descending into sub-tables.
fn flatten(prefix: &str, table: toml::Table, out: &mut Vec<(String, toml::Value)>) {
    for (key, value) in table {
        match value {
            toml::Value::Table(t) => flatten(&format!("{prefix}{key}."), t, out),
            v => out.push((format!("{prefix}{key}"), v)),
        }
    }
}

/// The argument of `sub` that `key` (maybe `table.key`) sets, or an error naming the closest.
fn resolve_key<'a>(
    sub: &'a Command,
    name: &str,
    path: &Path,
    key: &str,
    value: &toml::Value,
) -> Result<&'a Arg> {
    let flag = key.rsplit('.').next().unwrap_or(key).replace('_', "-");
    let Some(arg) = find_arg(sub, &flag) else {
        let hint = closest(sub, &flag)
            .map(|c| format!("; did you mean `{}` (--{c})?", c.replace('-', "_")))
            .unwrap_or_default();
        bail!(
            "{}: unknown key `{key}`: `{name}` has no flag --{flag}{hint}",
            path.display()
        );
    };
    if flag == "config" {
        let nested = match value {
            toml::Value::String(s) => s.to_ascii_lowercase().ends_with(".toml"),
            _ => false,
        };
        if nested || find_arg(sub, "config").is_none() {
            bail!(
                "{}: key `{key}`: a config file cannot load another config file",
                path.display()
            );
        }
    }
    Ok(arg)
}

/// The arguments `value` stands for as the value of `arg`.
fn to_tokens(arg: &Arg, value: &toml::Value) -> Result<Vec<String>> {
    let flag = format!("--{}", long(arg));
    let switch = |v: &toml::Value| match v {
        toml::Value::Boolean(b) => Ok(*b),
        other => bail!(
            "{flag} is a switch: expected true or false, got {}",
            other.type_str()
        ),
    };
    match arg.get_action() {
        ArgAction::SetTrue | ArgAction::SetFalse => {
            Ok(if switch(value)? { vec![flag] } else { vec![] })
        }
        ArgAction::Count => match value {
            toml::Value::Integer(k) if (0..=64).contains(k) => Ok(vec![flag; *k as usize]),
            v => Ok(if switch(v)? { vec![flag] } else { vec![] }),
        },
        ArgAction::Set => {
            if let toml::Value::Array(_) = value {
                bail!("{flag} takes one value, got an array");
            }
            Ok(vec![format!("{flag}={}", scalar(arg, value)?)])
        }
        ArgAction::Append => {
            let items = match value {
                toml::Value::Array(items) => items.as_slice(),
                v => std::slice::from_ref(v),
            };
            let values = items
                .iter()
                .map(|v| scalar(arg, v))
                .collect::<Result<Vec<_>>>()?;
            Ok(match arg.get_value_delimiter() {
                Some(d) if !values.is_empty() => {
                    vec![format!("{flag}={}", values.join(&d.to_string()))]
                }
                _ => values.iter().map(|v| format!("{flag}={v}")).collect(),
            })
        }
        _ => bail!("{flag} cannot be set from a config file"),
    }
}

/// One value as text, checked with the flag's own value parser.
fn scalar(arg: &Arg, value: &toml::Value) -> Result<String> {
    let flag = format!("--{}", long(arg));
    let text = match value {
        toml::Value::String(s) => s.clone(),
        toml::Value::Integer(i) => i.to_string(),
        // Debug keeps a decimal point or exponent (`2.0`, `1e-20`), and `NaN`/`inf` parse back.
        toml::Value::Float(f) => format!("{f:?}"),
        toml::Value::Boolean(b) => b.to_string(),
        other => bail!(
            "{flag} takes a string or a number, got {}",
            other.type_str()
        ),
    };
    // The flag alone in a throwaway command: its parser (numbers, possible values) decides.
    let check = Command::new("check").no_binary_name(true).arg(
        Arg::new("v")
            .long("v")
            .action(ArgAction::Set)
            .value_parser(arg.get_value_parser().clone()),
    );
    if let Err(e) = check.try_get_matches_from([format!("--v={text}")]) {
        let why = std::error::Error::source(&e)
            .map(|s| s.to_string())
            .unwrap_or_else(|| {
                let s = e.to_string();
                let first = s.lines().next().unwrap_or_default();
                first
                    .trim_start_matches("error: ")
                    .replace("'--v <v>'", &flag)
            });
        bail!("invalid value {value} for {flag}: {why}");
    }
    Ok(text)
}

/// The ids of the arguments the user gave on the command line (before any `--`).
fn user_flags(sub: &Command, args: &[OsString]) -> HashSet<String> {
    let mut ids = HashSet::new();
    for a in args.iter().map(|a| a.to_string_lossy()) {
        if a == "--" {
            break;
        }
        let arg = if let Some(l) = a.strip_prefix("--") {
            find_arg(sub, l.split('=').next().unwrap_or(l))
        } else if let Some(c) = a.strip_prefix('-').and_then(|s| s.chars().next()) {
            sub.get_arguments().find(|x| x.get_short() == Some(c))
        } else {
            None
        };
        if let Some(arg) = arg {
            ids.insert(arg.get_id().to_string());
        }
    }
    ids
}

/// The argument of `sub` with long name (or visible alias) `flag`; help and version excluded.
fn find_arg<'a>(sub: &'a Command, flag: &str) -> Option<&'a Arg> {
    settable(sub).find(|a| {
        a.get_long_and_visible_aliases()
            .is_some_and(|names| names.contains(&flag))
    })
}

fn settable(sub: &Command) -> impl Iterator<Item = &Arg> {
    sub.get_arguments().filter(|a| {
        a.get_long().is_some()
            && !matches!(
                a.get_action(),
                ArgAction::Help | ArgAction::HelpShort | ArgAction::HelpLong | ArgAction::Version
            )
    })
}

fn long(arg: &Arg) -> &str {
    arg.get_long().unwrap_or_default()
}

/// The long flag of `sub` nearest to `flag` in edit distance, if any is reasonably near.
fn closest<'a>(sub: &'a Command, flag: &str) -> Option<&'a str> {
    settable(sub)
        .map(long)
        .map(|l| (edit_distance(l, flag), l))
        .filter(|(d, l)| *d <= (flag.len().max(l.len()) / 2).max(2))
        .min()
        .map(|(_, l)| l)
}

/// Levenshtein distance between `a` and `b`, in characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diag = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let next = (diag + usize::from(ca != *cb))
                .min(row[j] + 1)
                .min(row[j + 1] + 1);
            diag = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Cli;
    use clap::{CommandFactory, Parser};

    /// Writes `text` to a fresh `name` in a temporary directory.
    fn file(dir: &tempfile::TempDir, name: &str, text: &str) -> String {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_string()
    }

    fn run(args: &[&str]) -> Result<Vec<String>> {
        let argv = std::iter::once("flotilla")
            .chain(args.iter().copied())
            .map(OsString::from);
        Ok(expand(&Cli::command(), argv)?
            .into_iter()
            .map(|a| a.into_string().unwrap())
            .collect())
    }

    fn err(args: &[&str]) -> String {
        format!("{:#}", run(args).expect_err("expected an error"))
    }

    #[test]
    fn keys_become_flags_before_the_users_arguments() {
        let d = tempfile::tempdir().unwrap();
        let f = file(
            &d,
            "a.toml",
            "layers = 4\nseq_len = 64\nbucket-mb = 2.0\ndata = \"grammar\"\n",
        );
        let out = run(&["train", "--config", &f, "--steps", "2"]).unwrap();
        assert_eq!(
            out,
            [
                "flotilla",
                "train",
                "--layers=4",
                "--seq-len=64",
                "--bucket-mb=2.0",
                "--data=grammar",
                "--steps",
                "2"
            ]
        );
        assert_eq!(
            run(&["train", &format!("--config={f}")]).unwrap()[2],
            "--layers=4"
        );
    }

    #[test]
    fn command_line_flags_override_the_file() {
        let d = tempfile::tempdir().unwrap();
        let f = file(&d, "a.toml", "layers = 4\nsteps = 9\nbf16 = true\n");
        let out = run(&["train", "--steps=3", "--config", &f, "--layers", "1"]).unwrap();
        assert_eq!(
            out,
            ["flotilla", "train", "--bf16", "--steps=3", "--layers", "1"]
        );
        // A second file overrides the first; the command line still overrides both.
        let g = file(&d, "b.toml", "[train]\nsteps = 7\n");
        let out = run(&["train", "--config", &f, "--config", &g]).unwrap();
        assert_eq!(
            out,
            ["flotilla", "train", "--layers=4", "--bf16", "--steps=7"]
        );
    }

    #[test]
    fn booleans_arrays_and_tables() {
        let d = tempfile::tempdir().unwrap();
        let f = file(
            &d,
            "a.toml",
            "recompute = false\nno_progress = true\n\
             [data]\ndataset = [\"x\", \"y\"]\nweights = [0.7, 0.3]\n\
             [model.shape]\nd_model = 32\n",
        );
        let out = run(&["train", "--config", &f]).unwrap();
        assert_eq!(
            out[2..],
            [
                "--no-progress",
                "--dataset=x",
                "--dataset=y",
                "--weights=0.7,0.3",
                "--d-model=32"
            ]
        );
    }

    #[test]
    fn the_preset_key_and_nonfile_config_values_pass_through() {
        let d = tempfile::tempdir().unwrap();
        let f = file(&d, "a.toml", "config = \"small\"\n");
        assert_eq!(
            run(&["train", "--config", &f]).unwrap()[2],
            "--config=small"
        );
        // `--config tiny` is the preset: left alone, and it overrides the file's.
        let out = run(&["train", "--config", &f, "--config", "tiny"]).unwrap();
        assert_eq!(out[2..], ["--config", "tiny"]);
        let out = run(&["train", "--config", "tiny"]).unwrap();
        assert_eq!(out[2..], ["--config", "tiny"]);
    }

    #[test]
    fn unknown_keys_name_the_file_and_the_closest_flag() {
        let d = tempfile::tempdir().unwrap();
        let f = file(&d, "a.toml", "[model]\nlayer = 4\n");
        let e = err(&["train", "--config", &f]);
        assert!(e.contains("a.toml"), "{e}");
        assert!(e.contains("unknown key `model.layer`"), "{e}");
        assert!(e.contains("--layers"), "{e}");
        let f = file(&d, "b.toml", "help = true\n");
        assert!(err(&["train", "--config", &f]).contains("unknown key `help`"));
    }

    #[test]
    fn bad_values_are_named() {
        let d = tempfile::tempdir().unwrap();
        for (text, want) in [
            ("layers = \"four\"", "--layers"),
            ("layers = true", "--layers"),
            ("layers = [1, 2]", "takes one value"),
            ("bf16 = 1", "expected true or false"),
            ("steps = -1", "--steps"),
            ("seed = 1979-05-27", "datetime"),
            ("bucket_mb = { a = 1 }", "unknown key `bucket_mb.a`"),
        ] {
            let f = file(&d, "bad.toml", text);
            let e = err(&["train", "--config", &f]);
            assert!(e.contains("bad.toml") && e.contains(want), "{text}: {e}");
        }
    }

    #[test]
    fn broken_missing_and_nested_files_are_refused() {
        let d = tempfile::tempdir().unwrap();
        let f = file(&d, "broken.toml", "layers = 4\nsteps = = 2\n");
        let e = err(&["train", "--config", &f]);
        assert!(e.contains("broken.toml") && e.contains("line 2"), "{e}");
        let e = err(&["train", "--config", "/nonexistent/run.toml"]);
        assert!(e.contains("/nonexistent/run.toml"), "{e}");
        let f = file(&d, "nest.toml", "config = \"other.toml\"\n");
        assert!(err(&["train", "--config", &f]).contains("cannot load another config file"));
        let f = file(&d, "twice.toml", "seq_len = 1\nseq-len = 2\n");
        assert!(err(&["train", "--config", &f]).contains("given twice"));
    }

    #[test]
    fn commands_without_a_preset_take_any_path() {
        let d = tempfile::tempdir().unwrap();
        let f = file(&d, "stress.cfg", "workers = 3\n");
        let out = run(&["data", "stress", "--config", &f]).unwrap();
        assert_eq!(out[1..], ["data", "stress", "--workers=3"]);
        let f = file(&d, "nest.cfg", "config = \"x\"\n");
        let e = err(&["data", "stress", "--config", &f]);
        assert!(e.contains("unknown key `config`"), "{e}");
    }

    #[test]
    fn the_example_config_parses_into_train_options() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../examples/train-small.toml"
        );
        let out = run(&["train", "--config", path, "--steps", "2"]).unwrap();
        let cli = Cli::try_parse_from(&out).unwrap_or_else(|e| panic!("{out:?}: {e}"));
        assert!(matches!(cli.command, crate::Command::Train(_)));
    }
}
