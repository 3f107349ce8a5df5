// A client of specd's public API generated from protos/specd/v1/router.proto
// alone (no worker protocol), as a team calling specd from Node.js would write
// it: stream a completion, then read which field an invalid request got wrong
// from the standard error model (google.rpc.Status + BadRequest).
//
// usage: node client.js ADDRESS PROTOS_DIR GOOGLEAPIS_DIR
// prints one JSON object for tests/test_e2e_api.py.
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const protobuf = require("protobufjs");

const [address, protosDir, googleapisDir] = process.argv.slice(2);

const definition = protoLoader.loadSync("specd/v1/router.proto", {
  includeDirs: [protosDir], keepCase: true, longs: String, enums: String, defaults: true, oneofs: true,
});
const specd = grpc.loadPackageDefinition(definition).specd.v1;
const client = new specd.Router(address, grpc.credentials.createInsecure());

function generate(request) {
  return new Promise((resolve, reject) => {
    const pieces = [];
    let finish = null;
    const call = client.Generate(request);
    call.on("data", (msg) => {
      pieces.push(msg.text);
      if (msg.finish) finish = msg.finish;
    });
    call.on("error", reject);
    call.on("end", () => resolve({ text: pieces.join(""), finish }));
  });
}

function richError(err) {
  const root = new protobuf.Root();
  root.resolvePath = (_origin, target) => path.join(googleapisDir, target);
  root.loadSync(["google/rpc/status.proto", "google/rpc/error_details.proto"]);
  const Status = root.lookupType("google.rpc.Status");
  const [bin] = err.metadata.get("grpc-status-details-bin");
  const status = Status.decode(bin);
  const details = status.details.map((any) => {
    const name = any.type_url.split("/").pop();
    return { type: name, value: root.lookupType(name).decode(any.value).toJSON() };
  });
  return { code: err.code, status_code: status.code, message: status.message, details };
}

async function main() {
  const out = {};
  const ok = await generate({ prompt: "1, 2, 3, 4,", max_tokens: 8 });
  out.text = ok.text;
  out.finish_reason = ok.finish && ok.finish.reason;
  out.generated_tokens = ok.finish && ok.finish.usage.generated_tokens;
  try {
    await generate({ prompt: "1, 2, 3, 4,", max_tokens: 8, speculative: { n_max: 1000 } });
    out.invalid = "accepted";
  } catch (err) {
    out.invalid = richError(err);
  }
  client.close();
  console.log(JSON.stringify(out));
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
