//! Mutating the numbers of a JSON document (the fuzz targets of ckpt and data share it): every
//! number's path of keys and indices, and the value at a path.

/// Every number in `v`, as a path of keys and indices.
pub fn number_paths(v: &serde_json::Value, at: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    match v {
        serde_json::Value::Number(_) => out.push(at.clone()),
        serde_json::Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                at.push(i.to_string());
                number_paths(x, at, out);
                at.pop();
            }
        }
        serde_json::Value::Object(o) => {
            for (k, x) in o {
                at.push(k.clone());
                number_paths(x, at, out);
                at.pop();
            }
        }
        _ => {}
    }
}

/// The value at `path` (keys and indices, as [`number_paths`] gives them).
pub fn at_path<'a>(v: &'a mut serde_json::Value, path: &[String]) -> &'a mut serde_json::Value {
    path.iter().fold(v, |v, k| match v {
        serde_json::Value::Array(a) => &mut a[k.parse::<usize>().unwrap()],
        other => &mut other[k.as_str()],
    })
}
