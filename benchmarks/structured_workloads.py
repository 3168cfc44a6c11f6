"""The workloads of `structured.py`.

- `schemas`: a chat request for a JSON value of a real-world schema from `../shared/data/maskbench/`
  (those without a keyword the backend loosens), `pick_schemas`.
- `extraction`: seeded synthetic documents (invoices, people records, product listings, orders)
  with names, ids, emails, addresses, amounts, dates and arrays of objects (line items, so keys
  repeat), each with a JSON schema that requires the fields whose values the document holds, and a
  chat prompt asking to extract them as JSON. `extraction_docs(n, seed)` is deterministic.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from services.grammar.fidelity import loosened_keywords

MASKBENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "maskbench"

FIRST = (
    "Jane Omar Priya Lukas Mei Tomasz Aisha Diego Hannah Kwame Sofia Yusuf Elena Ravi Chloe Ivan"
)
LAST = "Smith Haddad Patel Becker Chen Nowak Bello Alvarez Murphy Mensah Rossi Demir Petrova Iyer"
STREETS = ("Harbour Street", "Mill Lane", "King Street", "Station Road", "Elm Avenue", "Quay Side")
CITIES = (
    ("Leeds", "LS1 4AB", "United Kingdom"),
    ("Lyon", "69002", "France"),
    ("Porto", "4050-123", "Portugal"),
    ("Hamburg", "20095", "Germany"),
    ("Utrecht", "3511 AB", "Netherlands"),
    ("Gdansk", "80-831", "Poland"),
)
COMPANIES = (
    "Acme Tools Ltd",
    "Northwind Logistics",
    "Bluebird Stationery",
    "Kestrel Outdoor Gear",
    "Larkspur Coffee Co",
    "Meridian Lab Supplies",
)
PRODUCTS = (
    ("Cordless drill", 89.5),
    ("Drill bit set", 14.99),
    ("A4 notebook", 3.2),
    ("Fountain pen", 24.0),
    ("Trail backpack", 74.95),
    ("Camping stove", 39.9),
    ("Espresso beans 1kg", 18.5),
    ("Ceramic mug", 9.75),
    ("Pipette tips (box)", 12.4),
    ("Nitrile gloves (100)", 8.99),
)
CURRENCIES = ("GBP", "EUR", "USD")

STR, NUM, INT = {"type": "string"}, {"type": "number"}, {"type": "integer"}


@dataclass(frozen=True)
class Doc:
    kind: str
    text: str
    schema: dict


def _obj(**props: dict) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


def _arr(item: dict, n: int) -> dict:
    """`n` items: the document's count (an open array lets a small model add items forever)."""
    return {"type": "array", "items": item, "minItems": n, "maxItems": n}


LINE_ITEM = _obj(sku=STR, product=STR, quantity=INT, unit_price=NUM)  # invoices and orders


def _name(rng: random.Random) -> tuple[str, str]:
    first, last = rng.choice(FIRST.split()), rng.choice(LAST.split())
    return f"{first} {last}", f"{first.lower()}.{last.lower()}"


def _date(rng: random.Random, year: int = 2024) -> str:
    return f"{year}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _address(rng: random.Random) -> dict:
    city, postal, country = rng.choice(CITIES)
    street = f"{rng.randint(1, 240)} {rng.choice(STREETS)}"
    return {"street": street, "city": city, "postal_code": postal, "country": country}


def _lines(rng: random.Random, n: int) -> list[dict]:
    picked = rng.sample(PRODUCTS, n)
    return [
        {"sku": f"SK-{rng.randint(1000, 9999)}", "product": p, "quantity": rng.randint(1, 9),
         "unit_price": price}
        for p, price in picked
    ]  # fmt: skip


def invoice(rng: random.Random) -> Doc:
    number, issued, due = f"INV-2024-{rng.randint(100, 9999):04d}", _date(rng), _date(rng, 2025)
    seller, buyer, addr = rng.choice(COMPANIES), _name(rng), _address(rng)
    lines, cur = _lines(rng, rng.randint(2, 3)), rng.choice(CURRENCIES)
    total = round(sum(x["quantity"] * x["unit_price"] for x in lines), 2)
    email = f"{buyer[1]}@{seller.split()[0].lower()}-client.example"
    text = "\n".join(
        [
            f"INVOICE {number}   Issued: {issued}   Due: {due}",
            f"From: {seller}",
            f"Bill to: {buyer[0]} <{email}>, {addr['street']}, {addr['city']} {addr['country']}",
            "Items:",
            *(
                f"  {x['sku']}  {x['product']}  qty {x['quantity']} @ {x['unit_price']:.2f}"
                for x in lines
            ),
            f"Total due: {total:.2f} {cur}",
        ]
    )
    customer = _obj(name=STR, email=STR, street=STR, city=STR)
    schema = _obj(
        invoice_number=STR, issued=STR, due=STR, seller=STR, customer=customer,
        items=_arr(LINE_ITEM, len(lines)), total=NUM, currency=STR,
    )  # fmt: skip
    return Doc("invoice", text, schema)


def people(rng: random.Random) -> Doc:
    company, dept = rng.choice(COMPANIES), f"D-{rng.randint(10, 99):03d}"
    lines = [f"Staff directory: {company}, department {dept}", ""]
    domain = company.split()[0].lower() + ".example"
    count = rng.randint(2, 3)
    for i in range(count):
        name, handle = _name(rng)
        addr, eid = _address(rng), f"E-{rng.randint(10000, 99999)}"
        lines += [
            f"{i + 1}. {name} (employee {eid}), started {_date(rng, rng.randint(2012, 2024))}",
            f"   Email: {handle}@{domain}   Office: {addr['street']}, {addr['city']}",
        ]
    person = _obj(employee_id=STR, name=STR, email=STR, started=STR, office_city=STR)
    schema = _obj(company=STR, department_id=STR, employees=_arr(person, count))
    return Doc("people", "\n".join(lines), schema)


def listing(rng: random.Random) -> Doc:
    shop, seller = rng.choice(COMPANIES), f"S-{rng.randint(1000, 9999)}"
    contact = f"{_name(rng)[1]}@{shop.split()[0].lower()}.example"
    cur = rng.choice(CURRENCIES)
    lines = [f"Marketplace page for {shop} (seller {seller}, contact {contact}), {_date(rng)}", ""]
    count = rng.randint(2, 3)
    for product, price in rng.sample(PRODUCTS, count):
        pid, stock, rating = f"P-{rng.randint(10000, 99999)}", rng.randint(0, 40), rng.randint(1, 5)
        lines.append(
            f"* {product} | id {pid} | {price:.2f} {cur} | {stock} in stock | rated {rating}/5"
        )
    product = _obj(product_id=STR, name=STR, price=NUM, stock=INT, rating=INT)
    schema = _obj(
        shop=STR, seller_id=STR, contact_email=STR, currency=STR, products=_arr(product, count)
    )
    return Doc("listing", "\n".join(lines), schema)


def order(rng: random.Random) -> Doc:
    oid, placed, (name, handle) = f"ORD-{rng.randint(100000, 999999)}", _date(rng), _name(rng)
    addr, lines = _address(rng), _lines(rng, rng.randint(2, 3))
    shipping = rng.choice((0.0, 4.95, 7.5))
    text = "\n".join(
        [
            f"Order confirmation {oid}, placed {placed} by {name} <{handle}@mail.example>.",
            f"Ship to: {addr['street']}, {addr['postal_code']} {addr['city']}, {addr['country']}.",
            "Order lines:",
            *(
                f"  {x['quantity']} x {x['product']} (SKU {x['sku']}) at {x['unit_price']:.2f}"
                for x in lines
            ),
            f"Shipping: {shipping:.2f}",
        ]
    )
    ship_to = _obj(street=STR, city=STR, postal_code=STR, country=STR)
    schema = _obj(
        order_id=STR, placed=STR, customer=STR, email=STR, ship_to=ship_to,
        lines=_arr(LINE_ITEM, len(lines)), shipping=NUM,
    )  # fmt: skip
    return Doc("order", text, schema)


KINDS = (invoice, people, listing, order)


def extraction_docs(n: int = 32, seed: int = 0) -> list[Doc]:
    """`n` documents, the kinds in turn, each from its own seeded generator."""
    return [KINDS[i % len(KINDS)](random.Random(seed * 100_003 + i)) for i in range(n)]


def extraction_messages(doc: Doc) -> list[dict]:
    ask = (
        f"Extract the data of this {doc.kind} document as JSON, nothing else, with this "
        f"schema: {json.dumps(doc.schema)}\n\nDocument:\n{doc.text}"
    )
    return [{"role": "user", "content": ask}]


@dataclass(frozen=True)
class Workload:
    name: str
    items: list[tuple[list[dict], dict]]  # (chat messages, schema)
    max_tokens: int


def pick_schemas(n: int) -> list[dict]:
    out = []
    for f in sorted(MASKBENCH.glob("*.json")):
        schema = json.loads(f.read_text())["schema"]
        text = json.dumps(schema)
        if not loosened_keywords(schema) and len(text) < 1200:
            out.append(schema)
        if len(out) == n:
            break
    return out


def make_workloads(
    names: list[str], n: int, max_tokens: int, extraction_max_tokens: int, seed: int
) -> list[Workload]:
    """The workloads named, with `n` schemas (or at least 32 documents) each."""
    out = []
    for name in names:
        if name == "schemas":
            ask = "Produce a JSON value for this schema, nothing else: "
            items = [
                ([{"role": "user", "content": ask + json.dumps(s)}], s) for s in pick_schemas(n)
            ]
            out.append(Workload(name, items, max_tokens))
        elif name == "extraction":
            docs = extraction_docs(max(n, 32), seed)
            items = [(extraction_messages(d), d.schema) for d in docs]
            out.append(Workload(name, items, extraction_max_tokens))
        else:
            raise SystemExit(f"--workloads: unknown {name!r} (schemas, extraction)")
    return out
