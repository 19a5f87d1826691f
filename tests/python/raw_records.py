"""Writes Kafka records the way other teams' producers do: header names and values as
raw bytes (Go's Sarama and franz-go write names that are not UTF-8), binary keys, null
keys or values. kafka-python encodes a header name with `name.encode("utf-8")`, so a
`str` whose `encode` returns the raw bytes writes any name.

    python3 raw_records.py BOOTSTRAP TOPIC < records.json

records.json: a list of {"key": b64|null, "value": b64|null (not both null: kafka-python
refuses that, and header values must be bytes; the Rust tests write those with rdkafka),
"headers": [[name_b64, value_b64], ...]}, written in order to partition 0.
Prints one JSON line per record: {"offset": n}.
"""

import base64
import json
import sys

from kafka import KafkaProducer


class RawName(str):
    """A header name whose encoding is the given bytes, whatever they are."""

    def __new__(cls, raw):
        obj = super().__new__(cls, raw.decode("latin-1"))
        obj._raw = raw
        return obj

    def encode(self, *args, **kwargs):
        return self._raw


def b(v):
    return None if v is None else base64.b64decode(v)


def main():
    bootstrap, topic = sys.argv[1], sys.argv[2]
    records = json.load(sys.stdin)
    producer = KafkaProducer(bootstrap_servers=bootstrap, api_version=(2, 5, 0), acks="all")
    for r in records:
        headers = [(RawName(b(n)), b(v)) for n, v in r.get("headers", [])]
        meta = producer.send(
            topic, key=b(r.get("key")), value=b(r.get("value")), headers=headers, partition=0
        ).get(timeout=30)
        print(json.dumps({"offset": meta.offset}), flush=True)
    producer.flush()


if __name__ == "__main__":
    main()
