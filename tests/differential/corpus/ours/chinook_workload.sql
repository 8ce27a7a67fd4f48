-- OURS: a small shop workload on the vendored Chinook schema (Chinook_PostgreSql.sql: keys without defaults,
-- so new keys are max()+n)
INSERT INTO artist (artist_id, name) SELECT max(artist_id) + 1, 'Corpus Quartet' FROM artist;

INSERT INTO invoice (invoice_id, customer_id, invoice_date, billing_address, billing_city, billing_country, total) SELECT 1000 + customer_id, customer_id, TIMESTAMP '2026-11-25 10:00', address, city, country, 0.99 * 3 FROM customer WHERE customer_id <= 40;

UPDATE track SET unit_price = unit_price + 0.10 WHERE genre_id = 1;

UPDATE customer SET email = lower(email), support_rep_id = 3 WHERE country = 'Brazil';

DELETE FROM playlist_track WHERE playlist_id = 1 AND track_id % 3 = 0;

UPDATE employee SET reports_to = NULL, title = title || ' (acting)' WHERE employee_id = 2;

UPDATE album SET title = title || repeat(' remastered', 1) WHERE album_id % 10 = 0;
